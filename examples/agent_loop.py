"""An agent loop against kvsplice, through the `openai` client and through LangChain.

    python examples/agent_loop.py                       # starts a server on the default model (SmolLM2-135M)
    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1   # or uses a running one

Each loop offers two tools, lets the model call them (tool_choice "required": the reply is always a
valid call, whatever the model), feeds the results back, then edits its context the way agents do
(the first, long tool result is dropped) and asks for the final answer (tool_choice "none"). It
prints, per turn, where the prompt's K/V came from (usage.reuse): the edited turn relocates the
tokens after the dropped result instead of prefilling them again.

A model as small as SmolLM2-135M picks tools and arguments poorly; the loop does not depend on
it choosing well, only on the calls being valid, which grammar-constrained decoding guarantees.
"""

from __future__ import annotations

import argparse
import json
import sys

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the project and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the documentation; returns matching paragraphs.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                        "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
                       "required": ["query", "limit"], "additionalProperties": False}}},
]
SYSTEM = ("You are a software agent. You answer questions about a Python project by calling tools: read_file "
          "reads a file, search_docs searches the documentation. Call a tool when you need facts; when you "
          "have them, answer in two sentences. ") * 3
QUESTION = "What does the function main in app.py print, and what does the documentation say about it?"


def run_tool(name: str, arguments: str) -> str:
    """Scripted tools with long results (what makes an agent's context grow)."""
    args = json.loads(arguments)
    if name == "read_file":
        return (f"# {args.get('path', 'app.py')}\n" + "def main():\n    print('hello world')\n    return None\n\n"
                + "# main prints a greeting and returns None when nothing is found.\n" * 20)
    return ("The documentation says: main() is the entry point. It prints 'hello world' and returns None. "
            "Run it with python app.py. ") * 12


def reuse_line(turn: str, usage: dict) -> str:
    reuse = usage["reuse"]
    return (f"{turn:<28} prompt {usage['prompt_tokens']:>5}  prefix {reuse['prefix_tokens']:>5}  "
            f"relocated {reuse['relocated_tokens']:>5}  prefilled {reuse['prefilled_tokens']:>5}  "
            f"session {reuse['session']}  fallback {reuse['fallback']}")


def openai_loop(base_url: str, model: str) -> int:
    """The loop with the openai client; returns the edited turn's relocated tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=600)
    extra = {"session_id": "example-openai", "cache_salt": "example-openai"}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    for turn in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=64, temperature=0,
                                               extra_body=extra)
        message = reply.choices[0].message
        call = message.tool_calls[0]
        print(reuse_line(f"openai turn {turn + 1}: {call.function.name}", reply.usage.model_dump()))
        print(f"    call {call.function.name}({call.function.arguments})")
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.name,
                                                                                      call.function.arguments)})
    first = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    messages[first] = {**messages[first], "content": "(file read earlier; dropped to save context)"}
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=48, temperature=0, extra_body=extra)
    usage = final.usage.model_dump()
    print(reuse_line("openai edited turn: answer", usage))
    print(f"    answer: {final.choices[0].message.content!r}")
    return usage["reuse"]["relocated_tokens"]


def langchain_loop(base_url: str, model: str) -> int:
    """The same loop with LangChain's ChatOpenAI; returns the edited turn's relocated tokens."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, max_tokens=64, temperature=0, timeout=600,
                     extra_body={"session_id": "example-langchain", "cache_salt": "example-langchain"})
    history = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    agent = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    for turn in range(2):
        ai = agent.invoke(history)
        call = ai.tool_calls[0]
        print(reuse_line(f"langchain turn {turn + 1}: {call['name']}", ai.response_metadata["token_usage"]))
        history += [ai, ToolMessage(run_tool(call["name"], json.dumps(call["args"])), tool_call_id=call["id"])]
    first = next(i for i, m in enumerate(history) if isinstance(m, ToolMessage))
    history[first] = ToolMessage("(file read earlier; dropped to save context)", tool_call_id=history[first].tool_call_id)
    answer = llm.bind_tools(TOOLS, tool_choice="none", max_tokens=48).invoke(history)
    usage = answer.response_metadata["token_usage"]
    print(reuse_line("langchain edited turn: answer", usage))
    print(f"    answer: {answer.content!r}")
    return usage["reuse"]["relocated_tokens"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="an OpenAI-compatible kvsplice URL ending in /v1 "
                                                         "(default: start a server on the default model)")
    parser.add_argument("--model", default=None, help="model directory for the started server")
    args = parser.parse_args(argv)
    server = None
    if args.base_url is None:
        from kvsplice.config import EngineConfig
        from kvsplice.server.api import ServerSettings
        from kvsplice.server.launch import ServerThread, build_app
        from kvsplice.server.request_log import RequestLog

        app = build_app(EngineConfig(model=args.model), ServerSettings(model_path=args.model), RequestLog(sys.stderr))
        server = ServerThread(app)
        server.start(timeout_s=600)
        args.base_url = f"{server.url}/v1"
    try:
        import httpx

        model = httpx.get(f"{args.base_url}/models", timeout=30).json()["data"][0]["id"]
        relocated = [openai_loop(args.base_url, model), langchain_loop(args.base_url, model)]
    finally:
        if server is not None:
            server.stop()
    ok = all(r > 0 for r in relocated)
    print("OK: the edited turns relocated" if ok else "FAIL: an edited turn relocated nothing", relocated)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
