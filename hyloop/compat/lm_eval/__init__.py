"""hyloop as an lm-eval-harness model (``model.py``: ``--model hyloop``).

lm-eval 0.4.13 loads no model plug-ins, so ``python -m hyloop.compat.lm_eval ARGS...`` is
lm-eval's own command line with hyloop's model registered first."""
