"""Tool parsers by name (vLLM's names) and the choice of one from a chat template.

    get_parser("hermes")            -> HermesToolParser()      (ValueError listing the names if unknown)
    detect_parser(chat_template)    -> the parser whose syntax the template writes, else hermes

Detection reads the template source for each family's marker: `[TOOL_CALLS]` (Mistral),
`<tool_call>` (Hermes, Qwen 2.5 / 3), `<|python_tag|>` or a `"parameters"` call object (Llama 3.1 /
3.2). A template with none of them has no tool syntax of its own; kvsplice then offers tools in
the Hermes format (it explains the format in the system prompt).
"""

from __future__ import annotations

from typing import Optional

from kvsplice.server.tool_parsers.base import ToolParser
from kvsplice.server.tool_parsers.hermes import HermesToolParser
from kvsplice.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvsplice.server.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser,
                                                                   MistralToolParser)}
DEFAULT_PARSER = HermesToolParser.name


def get_parser(name: str) -> ToolParser:
    """A new parser of the given vLLM name; ValueError naming the known ones otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return cls()


def detect_parser(chat_template: Optional[str]) -> ToolParser:
    """The parser matching the tool syntax `chat_template` renders (see the module docstring)."""
    source = chat_template or ""
    if "[TOOL_CALLS]" in source:
        return MistralToolParser()
    if "<tool_call>" in source:
        return HermesToolParser()
    if "<|python_tag|>" in source or '"parameters": ' in source:
        return Llama3JsonToolParser()
    return get_parser(DEFAULT_PARSER)
