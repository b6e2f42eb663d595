"""Stands in for vLLM's `tests/utils.py`: `RemoteOpenAIServer` is the kvsplice server under test.

vLLM's fixture launches `vllm serve MODEL ARGS`; here the server is already running (one for the
whole session), so the model and arguments are ignored and nothing is started or stopped.
"""

from __future__ import annotations

import openai

from served import server_url

API_KEY = "token-abc123"  # what vLLM's helper sends; kvsplice runs without --api-key, so any key is accepted


class RemoteOpenAIServer:
    def __init__(self, model: str, vllm_serve_args: list[str] | None = None, **_ignored) -> None:
        self.model = model
        self.url_root = server_url()

    def __enter__(self) -> "RemoteOpenAIServer":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0, **kwargs)
