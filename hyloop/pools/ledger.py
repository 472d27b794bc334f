"""``LedgerError``: a pool's books disagree with what admission promised.

Raised where a promise the ledger makes is found broken (a reserved page that is not there, a
request an idle engine cannot admit). It is never one request's fault, so the engine does not
fail a request for it: it stops, ending every request with the error (``framework.faults``).
"""

from __future__ import annotations


class LedgerError(RuntimeError):
    """A pool or cache invariant does not hold (an engine bug, not a bad request)."""
