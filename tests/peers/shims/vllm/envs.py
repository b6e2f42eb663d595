"""vLLM's environment switches that its tests read: kvsplice is neither of vLLM's front ends, and the
tests take their Python-server branch (the OpenAI HTTP behaviour both share)."""

VLLM_USE_RUST_FRONTEND = False
