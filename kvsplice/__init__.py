"""kvsplice: an LLM serving engine with Suffix Cache Reuse.

Public API: `LLM` and `SamplingParams` (offline), `kvsplice serve` (OpenAI-compatible server).
"""

from kvsplice.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it lazily so `import kvsplice` stays cheap.
    if name in ("LLM", "GenerationResult"):
        from kvsplice.engine import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
