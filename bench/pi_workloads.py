"""The two RAG-shaped workloads of ``bench/position_independent.py``, as token ids.

Each has a registration wave (every document behind one system prompt, so its KV is in the
cache) and a query wave (several documents behind another prompt; every query leads with a
different document, so the exact prefix serves the system prompt only and never a document).

* ``modules``: the project's RAG bench. Documents of 500-1,000 tokens: the docstrings of Python
  standard-library modules and their members. Queries: two documents, then a question.
* ``reference``: other documents and queries. Documents of 350-700 tokens: sections of the
  Python language reference (``pydoc_data.topics``), registered behind another system prompt.
  Queries: three numbered documents, then one of four questions and an answer cue.
"""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass
from typing import Any

MODULES = [
    "argparse", "json", "csv", "statistics", "re", "heapq", "itertools", "socket",
    "ssl", "urllib.request", "subprocess", "difflib", "http.client", "tempfile",
]  # fmt: skip
SYSTEM_A = "You are a librarian. Read the reference document and file it under a topic.\n\n"
SYSTEM_B = (
    "You are a careful assistant. Answer the question using only the documents below; "
    "say which document you used.\n\n"
)
TOPICS = [
    "assignment", "comparisons", "execmodel", "import", "try", "calls", "function", "naming",
    "numeric-types", "objects", "async", "raise", "with", "class", "exceptions", "for",
]  # fmt: skip
SYSTEM_C = "Index the following section of the Python language reference.\n\nSection:\n"
SYSTEM_D = (
    "You answer questions about Python for a reader who is new to it. Use the numbered "
    "reference sections the reader provides, quote them where it helps, and keep it short.\n\n"
)
QUESTIONS_D = [
    "How do these sections relate to each other?",
    "Which of these sections should a beginner read first, and why?",
    "What rule do these sections have in common?",
    "Give one example that touches all three sections.",
]


@dataclass
class Workload:
    name: str
    register: list[list[int]]  # prompts of the registration wave
    queries: list[tuple[list[int], int]]  # query prompts, with their document tokens


def module_text(name: str) -> str:
    """A module's docstring and its public members' docstrings, as one document."""
    mod = importlib.import_module(name)
    parts = [f"Document: the {name} module.\n{inspect.getdoc(mod) or ''}"]
    for attr in sorted(dir(mod)):
        obj = getattr(mod, attr)
        if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{attr}: {doc}")
    return "\n\n".join(parts)


def _leads(rng: random.Random, num_docs: int, num_queries: int) -> list[int]:
    if num_queries > num_docs:
        raise SystemExit(f"--queries {num_queries} > --docs {num_docs}: a lead document repeats")
    return rng.sample(range(num_docs), num_queries)


def modules(tok: Any, num_docs: int, num_queries: int, seed: int) -> Workload:
    rng = random.Random(seed)
    docs: list[list[int]] = []
    for name in MODULES:
        ids = tok.encode(module_text(name))
        if len(ids) >= 500:
            docs.append(ids[: rng.randint(500, 1000)])
        if len(docs) == num_docs:
            break
    if len(docs) < num_docs:
        raise SystemExit(f"only {len(docs)} module documents of >= 500 tokens; lower --docs")
    sys_a, sys_b = tok.encode(SYSTEM_A), tok.encode(SYSTEM_B)
    register = [sys_a + d + tok.encode("\n\nTopic:") for d in docs]
    queries = []
    for q, i in enumerate(_leads(rng, num_docs, num_queries)):
        j = rng.choice([d for d in range(num_docs) if d != i])
        question = tok.encode(f"\n\nQuestion {q}: what do these two modules have in common?\n")
        prompt = sys_b + docs[i] + tok.encode("\n\n") + docs[j] + question
        queries.append((prompt, len(docs[i]) + len(docs[j])))
    return Workload("modules", register, queries)


def reference(tok: Any, num_docs: int, num_queries: int, seed: int) -> Workload:
    from pydoc_data.topics import topics

    rng = random.Random(seed + 1)
    docs: list[list[int]] = []
    for name in TOPICS:
        ids = tok.encode(f"{name}: {topics[name].strip()}")
        if len(ids) >= 350:
            docs.append(ids[: rng.randint(350, 700)])
        if len(docs) == num_docs:
            break
    if len(docs) < num_docs:
        raise SystemExit(f"only {len(docs)} reference sections of >= 350 tokens; lower --docs")
    sys_c, sys_d = tok.encode(SYSTEM_C), tok.encode(SYSTEM_D)
    register = [sys_c + d + tok.encode("\n\nKeywords:") for d in docs]
    queries = []
    for q, i in enumerate(_leads(rng, num_docs, num_queries)):
        others = rng.sample([d for d in range(num_docs) if d != i], 2)
        prompt = sys_d + tok.encode("[1] ") + docs[i]
        for k, j in enumerate(others, 2):
            prompt += tok.encode(f"\n\n[{k}] ") + docs[j]
        question = QUESTIONS_D[q % len(QUESTIONS_D)]
        prompt += tok.encode(f"\n\nQuestion {q}: {question}\nAnswer:")
        queries.append((prompt, sum(len(docs[d]) for d in (i, *others))))
    return Workload("reference", register, queries)
