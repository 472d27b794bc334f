"""vLLM's offline surface over the engine core: ``LLM``, ``LLMEngine``, ``EngineArgs``, chat,
``n`` samples, beam search and the run summary. It imports the core; the core never imports it.
vLLM's module paths (``hyloop.sampling_params``, ``hyloop.outputs``, ...) re-export from here and
from the core."""
