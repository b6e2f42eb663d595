"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for: ToolPlan.

    tool_choice   tools in the prompt   replies parsed for calls   decoding
    none          yes                   no                         free
    auto          yes                   yes                        free (the model may answer in text)
    required      yes                   yes                        grammar: one or more calls of the tools
    {function}    yes                   yes                        grammar: one call of that function

`tool_choice` defaults to "auto" with tools and "none" without (OpenAI). With "none" the tools stay
in the prompt (as vLLM does by default): an agent's last, tool-free turn then keeps the prompt prefix
of its earlier turns, so its K/V come from the cache. A forced call's grammar
is written in the tool parser's syntax (kvsplice.structured: the arguments match each function's
JSON schema), so the reply always parses as calls. `parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvsplice.server.protocol import ChatCompletionRequest, NamedToolChoice
from kvsplice.server.tool_parsers import ToolParser
from kvsplice.structured.spec import StructuredSpec

# Arguments of a function that declares no parameters: any JSON object (OpenAI's default).
ANY_OBJECT = {"type": "object"}


class ToolRequestError(ValueError):
    """A tools / tool_choice combination that cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """template_tools: the tool definitions for the chat template (None: none offered).
    parse: read tool calls out of the reply. forced: the grammar of a required / named call, or None.
    max_calls: calls kept from a reply (None: all). keep_special_tokens: decode the reply with special
    tokens (the parser's marker is one, e.g. Mistral's [TOOL_CALLS])."""

    template_tools: Optional[list[dict[str, Any]]]
    parse: bool
    forced: Optional[StructuredSpec]
    max_calls: Optional[int]
    keep_special_tokens: bool


NO_TOOLS = ToolPlan(None, False, None, None, False)


def plan_tools(body: ChatCompletionRequest, parser: ToolParser, vocab: Optional[dict[str, int]],
               special_tokens: frozenset[str], reply_chars: Optional[int] = None) -> ToolPlan:
    """The ToolPlan of `body`; ToolRequestError for a choice that names no offered function or needs
    tools that are not there, or a forced call whose schema the grammar cannot take. `vocab` /
    `special_tokens`: the tokenizer's (for the parser's syntax). `reply_chars`: the most characters the
    reply can have (a forced call's schema bound above it is no constraint; None: unknown)."""
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if not tools and choice in ("none", "auto"):
        return NO_TOOLS
    if choice == "none":
        return ToolPlan(_template_tools(tools), False, None, None, False)
    if not tools:
        raise ToolRequestError(f"tool_choice {_describe(choice)} needs tools", "tool_choice")
    functions = [(tool.function.name, tool.function.parameters or ANY_OBJECT) for tool in tools]
    if isinstance(choice, NamedToolChoice):
        chosen = [(name, schema) for name, schema in functions if name == choice.function.name]
        if not chosen:
            raise ToolRequestError(f"tool_choice names the function {choice.function.name!r}, which is not "
                                   f"among the tools ({', '.join(name for name, _ in functions)})", "tool_choice")
        functions = chosen
    parallel = body.parallel_tool_calls is not False
    forced = None
    if choice != "auto":
        try:
            forced = StructuredSpec.tool_calls(parser.syntax(vocab), functions, reply_chars=reply_chars,
                                               parallel=parallel and not isinstance(choice, NamedToolChoice))
        except ValueError as error:
            raise ToolRequestError(str(error), "tools") from error
    keep_special = any(marker in special_tokens for marker in parser.markers)
    return ToolPlan(_template_tools(tools), True, forced, None if parallel else 1, keep_special)


def _template_tools(tools) -> list[dict[str, Any]]:
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _describe(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"naming {choice.function.name!r}"
