"""vLLM's version string: kvsplice has none of its own to offer under this name (the test is deselected)."""

__version__ = "not-vllm"
