"""Hand-made hostile requests against a real server: each is refused with a 4xx and OpenAI's error body
(naming the field where there is one), nothing answers 5xx, and afterwards the server is healthy with no
slot held by a request.

The shared server (tests/server/conftest.py) has a 2048-token context, so its default limits are: body
2048 x 16 + 1 MiB bytes, 2048 messages; 16 stop entries of at most 512 characters; ids of at most 256
characters; JSON nesting depth 64.
"""

from __future__ import annotations

import json
import select
import socket

import httpx
import pytest

from tests.server.conftest import assert_idle_without_leak

JSON = {"content-type": "application/json"}
HI = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


def _raw(text: str) -> bytes:
    """A body written by hand (to send escapes such as \\ud800 exactly as given)."""
    return text.encode("utf-8")


CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"   # MESSAGES answers in Anthropic's error shape
SERVED = "<served model>"   # a /v1/messages body's model, replaced by the served name when sent
ANT_HI = {"model": SERVED, "max_tokens": 2, "messages": HI}

# (case name, path, body: dict -> JSON, or bytes as they are, expected status, expected `param`)
CORPUS = [
    ("malformed JSON", CHAT, b"{not json", 400, None),
    ("truncated JSON", CHAT, b'{"messages": [', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("JSON array body", CHAT, b"[1, 2]", 400, None),
    ("JSON string body", COMPLETIONS, b'"hi"', 400, None),
    ("invalid UTF-8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("surrogate as UTF-8 bytes", CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, None),
    ("lone surrogate in a message", CHAT, _raw('{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
     400, "messages.0.content"),
    ("lone low surrogate in a message", CHAT, _raw('{"messages": [{"role": "user", "content": "\\udfff"}]}'),
     400, "messages.0.content"),
    ("lone surrogate in a text part", CHAT,
     _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'),
     400, "messages.0.content.0.text"),
    ("lone surrogate in a prompt", COMPLETIONS, _raw('{"prompt": "x\\ud800", "max_tokens": 2}'), 400, "prompt"),
    ("lone surrogate in /generate text", GENERATE, _raw('{"text": "\\ud800"}'), 400, "text"),
    ("lone surrogate in a stop string", CHAT,
     _raw('{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}'), 400, "stop.0"),
    ("lone surrogate in a key", CHAT, _raw('{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}'),
     400, "body"),
    ("NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("Infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, None),
    ("-Infinity", COMPLETIONS, b'{"prompt": "hi", "temperature": -Infinity}', 400, None),
    ("float overflowing to infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
     400, None),
    ("an int of 5000 digits", CHAT, _raw('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                                         + "9" * 5000 + "}"), 400, None),
    ("huge max_tokens", CHAT, _chat(max_tokens=10**30), 400, "max_tokens"),
    ("huge max_new_tokens", GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 2**63}}, 400,
     "sampling_params.max_new_tokens"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, 400, None),
    ("negative top_k", CHAT, _chat(top_k=-7), 400, None),
    ("negative logprobs", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logprobs": -1}, 400, None),
    ("seed beyond 64 bits", CHAT, _chat(seed=2**70), 400, None),
    ("huge temperature", CHAT, _chat(temperature=1e308, max_tokens=1), 200, None),
    ("negative token id", COMPLETIONS, {"prompt": [-1], "max_tokens": 1}, 400, None),
    ("huge token id", GENERATE, {"input_ids": [2**62], "sampling_params": {"max_new_tokens": 1}}, 400, None),
    ("messages is a string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message is a number", CHAT, {"messages": [1]}, 400, "messages.0"),
    ("role is a number", CHAT, {"messages": [{"role": 5, "content": "hi"}]}, 400, "messages.0.role"),
    ("content is a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("stream is a string", CHAT, _chat(stream="yes"), 400, "stream"),
    ("max_tokens is a float", CHAT, _chat(max_tokens=2.5), 400, "max_tokens"),
    ("temperature is a string", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("sampling_params is a list", GENERATE, {"text": "hi", "sampling_params": [1]}, 400, "sampling_params"),
    ("scr of the wrong type", CHAT, _chat(scr={"max_spans": "many"}), 400, None),
    ("scr is a number", CHAT, _chat(scr=5), 400, "scr"),
    ("deep nesting", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("nesting past the limit", CHAT, _raw('{"messages": [{"role": "user", "content": "hi"}], "scr": '
                                          + '{"a": ' * 70 + "1" + "}" * 70 + "}"), 400, None),
    ("empty stop string", CHAT, _chat(stop=""), 400, "stop"),
    ("empty stop string in a list", CHAT, _chat(stop=[""]), 400, "stop"),
    ("empty stop string on /generate", GENERATE, {"text": "hi", "sampling_params": {"stop": [""]}}, 400,
     "sampling_params.stop"),
    ("17 stop strings", CHAT, _chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("16 stop strings of 512 characters", CHAT, _chat(stop=["z" * 512] * 16), 200, None),
    ("a stop string of 513 characters", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "stop": "z" * 513}, 400,
     "stop"),
    ("17 stop token ids", CHAT, _chat(stop_token_ids=list(range(17))), 400, "stop_token_ids"),
    ("session_id of 257 characters", CHAT, _chat(session_id="s" * 257), 400, "session_id"),
    ("session_id of 256 characters", CHAT, _chat(session_id="s" * 256), 200, None),
    ("cache_salt of 257 characters", COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "cache_salt": "c" * 257}, 400,
     "cache_salt"),
    ("cache_salt of 256 characters", GENERATE,
     {"text": "hi", "cache_salt": "c" * 256, "sampling_params": {"max_new_tokens": 1}}, 200, None),
    ("rid of 257 characters", GENERATE, {"text": "hi", "rid": "r" * 257}, 400, "rid"),
    ("2049 messages", CHAT, {"messages": HI * 2049, "max_tokens": 1}, 400, "messages"),
    ("100,000 messages", CHAT, {"messages": HI * 100_000}, 413, None),
    ("10 MB prompt", COMPLETIONS, {"prompt": "word " * 2_000_000, "max_tokens": 1}, 413, None),
    ("prompt longer than the context", COMPLETIONS, {"prompt": "hello " * 3000, "max_tokens": 1}, 400, "prompt"),
    ("/generate text longer than the context", GENERATE, {"text": "hello " * 3000}, 400, "text"),
    ("/generate input_ids longer than the context", GENERATE, {"input_ids": [5] * 3000}, 400, "input_ids"),
    ("unknown model", CHAT, _chat(model="x" * 10_000), 404, "model"),
    ("lone surrogate in /tokenize", "/tokenize", _raw('{"prompt": "\\ud800"}'), 400, "prompt"),
    ("lone surrogate in /tokenize messages", "/tokenize",
     _raw('{"messages": [{"role": "user", "content": "\\udbff"}]}'), 400, "messages.0.content"),
    ("10 MB /tokenize prompt", "/tokenize", {"prompt": "word " * 2_000_000}, 413, None),
    ("/detokenize of a negative id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize of a string", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    # the Responses API and the Anthropic Messages API
    ("responses: malformed JSON", RESPONSES, b"{not json", 400, None),
    ("responses: lone surrogate in input", RESPONSES, _raw('{"input": "a\\ud800b"}'), 400, None),
    ("responses: input is a number", RESPONSES, {"input": 5}, 400, "input"),
    ("responses: NaN temperature", RESPONSES, b'{"input": "hi", "temperature": NaN}', 400, None),
    ("responses: huge max_output_tokens", RESPONSES, {"input": "hi", "max_output_tokens": 10**30}, 400,
     "max_output_tokens"),
    ("responses: 10 MB input", RESPONSES, {"input": "word " * 2_000_000}, 413, None),
    ("responses: deep nesting", RESPONSES, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("responses: unknown previous_response_id", RESPONSES, {"input": "hi", "previous_response_id": "resp_x" * 40},
     None, None),
    ("messages: malformed JSON", MESSAGES, b"{not json", 400, None),
    ("messages: lone surrogate in a message", MESSAGES,
     _raw('{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}'), 400, None),
    ("messages: messages is a string", MESSAGES, {**ANT_HI, "messages": "hi"}, 400, "messages"),
    ("messages: huge max_tokens", MESSAGES, {**ANT_HI, "max_tokens": 10**30}, 400, "max_tokens"),
    ("messages: NaN temperature", MESSAGES,
     b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     400, None),
    ("messages: 10 MB message", MESSAGES, {**ANT_HI, "messages": [{"role": "user", "content": "word " * 2_000_000}]},
     413, None),
    ("messages: deep nesting", MESSAGES, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("messages: a content block of an unknown type", MESSAGES,
     {**ANT_HI, "messages": [{"role": "user", "content": [{"type": "hologram", "data": "x" * 300}]}]}, 400, None),
    ("valid surrogate pair", CHAT, _raw('{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], '
                                        '"max_tokens": 1}'), 200, None),
]


def _send(server, path: str, body) -> httpx.Response:
    if isinstance(body, dict) and body.get("model") == SERVED:
        served = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"][0]["id"]
        body = {**body, "model": served}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=JSON, timeout=60)


def assert_openai_error(response: httpx.Response) -> dict:
    """The response's OpenAI error object (asserting its shape)."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize("name, path, body, status, param", CORPUS, ids=[case[0] for case in CORPUS])
def test_hostile_request_is_refused_cleanly(server, name, path, body, status, param):
    response = _send(server, path, body)
    if status is None:   # a 4xx whose status depends on the route's rules (e.g. 400 or 404)
        assert 400 <= response.status_code < 500, response.text[:500]
    else:
        assert response.status_code == status, response.text[:500]
    if response.status_code >= 400:
        error = assert_anthropic_error(response) if path.startswith(MESSAGES) else assert_openai_error(response)
        if param is not None:
            assert error["param"] == param, error


def assert_anthropic_error(response: httpx.Response) -> dict:
    """The error object of an Anthropic-shaped error body ({"type": "error", "error": {...}})."""
    body = response.json()
    assert body["type"] == "error", body
    error = body["error"]
    assert isinstance(error["type"], str) and isinstance(error["message"], str) and error["message"], error
    return error


def test_server_is_healthy_and_leak_free_after_the_corpus(server):
    for _, path, body, _, _ in CORPUS:
        assert _send(server, path, body).status_code < 500
    assert_idle_without_leak(server)


def _post_chunked_until_answered(url: str, path: str, chunks) -> bytes:
    """POST `chunks` with Transfer-Encoding: chunked over a raw socket, stopping as soon as the server
    answers or closes (a client library may instead fail on the broken pipe, or try to send the
    consumed body again); returns everything the server sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for chunk in chunks:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if select.select([sock], [], [], 0)[0]:
                    break   # the server has answered (or closed): stop sending
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        while b"\r\n\r\n" not in answer or not _has_whole_body(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def _has_whole_body(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_body_over_the_limit_without_content_length_is_413(server):
    """A chunked body is counted while it is read and refused once past the limit."""
    limit = server.state.limits.max_body_bytes

    def chunks():
        yield b'{"prompt": "'
        for _ in range(limit // 65536 + 2):
            yield b"w" * 65536
        yield b'"}'

    answer = _post_chunked_until_answered(server.url, COMPLETIONS, chunks())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"413", head
    error = json.loads(body)["error"]
    assert str(limit) in error["message"] and error["type"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_non_json_content_type_is_400(server):
    response = httpx.post(f"{server.url}{CHAT}", content=json.dumps(_chat()).encode(),
                          headers={"content-type": "text/plain"}, timeout=30)
    assert response.status_code == 400
    assert "application/json" in assert_openai_error(response)["message"]


def test_routing_key_header_over_the_id_limit_is_400(server):
    response = httpx.post(f"{server.url}{CHAT}", json=_chat(), headers={"X-SMG-Routing-Key": "k" * 257}, timeout=30)
    assert response.status_code == 400
    assert assert_openai_error(response)["param"] == "X-SMG-Routing-Key"


def test_head_health_and_method_errors(server):
    head = httpx.head(f"{server.url}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    for method, path, status in (("GET", "/flush_cache", 405), ("GET", CHAT, 405), ("GET", "/nowhere", 404),
                                 ("POST", "/nowhere", 404)):
        response = httpx.request(method, f"{server.url}{path}", timeout=10)
        assert response.status_code == status
        assert_openai_error(response)


def test_flush_cache_refuses_a_web_page(server):
    """A browser adds Origin to a cross-origin POST: a page the operator opens cannot flush the cache."""
    response = httpx.post(f"{server.url}/flush_cache", headers={"Origin": "https://evil.example"}, timeout=10)
    assert response.status_code == 403
    assert assert_openai_error(response)["code"] == "browser_request"
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200
