"""vLLM's `/tokenize` and `/detokenize`: text or chat messages -> token ids, and back, with the model's own
tokenizer and chat template (the same rendering `/v1/chat/completions` uses, so `count` is the
`prompt_tokens` a chat request with these messages reports).

    POST /tokenize    {"prompt": "text", "add_special_tokens": true}
                      {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, "tools": [...]}
                  ->  {"count": N, "max_model_len": L, "tokens": [...], "token_strs": null}
    POST /detokenize  {"tokens": [...]}  ->  {"prompt": "text"}

Defaults follow vLLM: a plain prompt gets the tokenizer's special tokens (e.g. BOS); chat messages do not
(the template writes them). `return_token_strs: true` adds each token's text. vLLM fields kvsplice does not
serve (`continue_final_message`, `chat_template`, `chat_template_kwargs`, `mm_processor_kwargs`) are refused
with 400, as is a chat-only field sent with `prompt`.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, model_validator

from kvsplice.server.chat import chat_prompt_ids
from kvsplice.server.protocol import ChatMessage
from kvsplice.tokenizer import Tokenizer

CHAT_ONLY_FIELDS = ("add_generation_prompt", "tools")


class TokenizeRequest(BaseModel):
    """POST /tokenize: exactly one of `prompt` (text) or `messages` (a chat, rendered by the template)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    tools: Optional[list[dict[str, Any]]] = None
    return_token_strs: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must contain at least one message")
        if self.prompt is not None:
            chat_only = [name for name in CHAT_ONLY_FIELDS if name in self.model_fields_set]
            if chat_only:
                raise ValueError(f"{chat_only[0]}: only applies to messages, not to prompt")
        for name in ("continue_final_message", "chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
            if getattr(self, name):
                raise ValueError(f"{name}: not supported")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text (special tokens kept, as vLLM does)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[StrictInt]


def tokenize(tokenizer: Tokenizer, body: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """The /tokenize answer. Raises ValueError when the chat template rejects the messages (or the model
    has none)."""
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)
        ids = chat_prompt_ids(tokenizer, body.messages, body.tools, add_generation_prompt=body.add_generation_prompt,
                              add_special_tokens=add_special)
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(body.prompt, add_special_tokens=add_special)
    token_strs = [tokenizer.token_str(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def check_token_ids(tokens: list[int], vocab_size: int) -> Optional[str]:
    """An error message for the first id outside [0, vocab_size), or None when all are valid."""
    for position, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            return f"tokens[{position}]: token id {token} is outside the vocabulary [0, {vocab_size})"
    return None


def detokenize(tokenizer: Tokenizer, tokens: list[int]) -> dict[str, Any]:
    """The /detokenize answer for ids already checked by check_token_ids."""
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}
