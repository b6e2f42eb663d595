"""Tool calls in model replies: one parser per model family, a registry, and streaming deltas.

    json_scan.py     incremental JSON scanning of a call that is still being written
    base.py          ToolParser, ParsedReply, PartialReply
    hermes.py        <tool_call>{json}</tool_call>  (Hermes, Qwen 2.5 / 3, and models without a tool syntax)
    llama3_json.py   {"name": ..., "parameters": ...}; ...  (Llama 3.1 / 3.2)
    mistral.py       [TOOL_CALLS] [{...}, ...]  (Mistral)
    registry.py      get_parser(name), detect_parser(chat_template)
    stream.py        ToolCallStream: reply text deltas -> OpenAI content / tool_call deltas
"""

from kvsplice.server.tool_parsers.base import ParsedCall, ParsedReply, ToolParser
from kvsplice.server.tool_parsers.registry import DEFAULT_PARSER, PARSERS, detect_parser, get_parser

__all__ = ["DEFAULT_PARSER", "PARSERS", "ParsedCall", "ParsedReply", "ToolParser", "detect_parser", "get_parser"]
