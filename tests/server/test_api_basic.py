"""End-to-end: the real openai client against a real server (chat, completions, streaming, usage)."""

from __future__ import annotations

import json

import httpx

from kvsplice.server.request_log import REQUEST_PREFIX, START_PREFIX


def client_model(client) -> str:
    """The served model name, as a client finds it."""
    return client.models.list().data[0].id


def test_models_lists_the_served_name(client, server):
    [card] = client.models.list().data
    assert card.id == server.state.engine.name


def test_chat_non_streaming_has_usage_and_reuse(client, server):
    out = client.chat.completions.create(model=server.state.engine.name, max_tokens=5, temperature=0,
                                         messages=[{"role": "user", "content": "Once upon a time"}])
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    reuse = out.usage.model_extra["reuse"]
    assert out.usage.prompt_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]


def test_second_turn_reports_cached_tokens(client, server):
    messages = [{"role": "system", "content": "Agents edit their own context. " * 8},
                {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    first = client.chat.completions.create(model=str(server.model_dir), max_tokens=4, temperature=0,
                                           messages=messages, extra_body={"session_id": "conv-1"})
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Tool results are long; notes are short."}]
    second = client.chat.completions.create(model=str(server.model_dir), max_tokens=4, temperature=0,
                                            messages=messages, extra_body={"session_id": "conv-1"})
    usage = second.usage
    assert usage.prompt_tokens_details.cached_tokens > 0
    reuse = usage.model_extra["reuse"]
    assert usage.prompt_tokens_details.cached_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"]
    assert usage.prompt_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]


def test_chat_streaming_with_usage_matches_non_streaming(client):
    messages = [{"role": "user", "content": "def main():"}]
    plain = client.chat.completions.create(model=client_model(client), messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model=client_model(client), messages=messages, max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=client_model(client), max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, messages=[{"role": "user", "content": "hello"}])
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # greedy: the chosen token is the most likely one
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-5


def test_chat_with_tool_calls_and_extras(client):
    messages = [
        {"role": "user", "content": "read the file"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.txt\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "hello world"},
    ]
    out = client.chat.completions.create(model=client_model(client), max_tokens=3, temperature=0.7, top_p=0.9,
                                         seed=3, stop=["\n\n"], messages=messages,
                                         extra_body={"top_k": 5, "min_p": 0.01, "ignore_eos": True,
                                                     "stop_token_ids": [0], "cache_salt": "tenant-a",
                                                     "scr": {"max_spans": 2}})
    assert out.usage.completion_tokens >= 1


def test_seed_makes_sampling_repeatable(client):
    kwargs = dict(model=client_model(client), max_tokens=6, temperature=1.0, seed=123,
                  messages=[{"role": "user", "content": "numbers"}], extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_completions_text_and_token_ids(client, server):
    tok = server.state.engine.tokenizer
    ids = tok.encode("Once upon a time")
    by_text = client.completions.create(model=client_model(client), prompt="Once upon a time", max_tokens=4,
                                        temperature=0)
    by_ids = client.completions.create(model=client_model(client), prompt=ids, max_tokens=4, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)


def test_completions_streaming(client):
    plain = client.completions.create(model=client_model(client), prompt="The quick", max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model=client_model(client), prompt="The quick", max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_completions_echo_max_tokens_zero(client, server):
    tok = server.state.engine.tokenizer
    prompt = "Tool results are long"
    out = client.completions.create(model=client_model(client), prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    ids = tok.encode(prompt)
    assert choice.text == prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert out.usage.completion_tokens == 0


def test_log_lines(server, client):
    client.chat.completions.create(model=client_model(client), max_tokens=2, temperature=0,
                                   messages=[{"role": "user", "content": "secret words here"}],
                                   extra_body={"session_id": "my-conversation"})
    lines = server.sink.lines()
    start = [json.loads(line[len(START_PREFIX):]) for line in lines if line.startswith(START_PREFIX)]
    assert len(start) == 1 and start[0]["model"] == server.state.engine.name
    assert start[0]["reuse"]["tail"] == server.state.engine.config.reuse.tail
    requests = [json.loads(line[len(REQUEST_PREFIX):]) for line in lines if line.startswith(REQUEST_PREFIX)]
    last = requests[-1]
    for key in ("rid", "prompt_tokens", "completion_tokens", "prefix_tokens", "relocated_tokens",
                "prefilled_tokens", "relocated_spans", "session", "fallback", "changed", "span_tails",
                "unchosen_spans", "uncached_unchanged", "ttft_s", "e2e_s", "finish_reason", "session_id", "replica"):
        assert key in last, key
    assert last["replica"] == "r0"
    assert last["session_id"] not in (None, "my-conversation") and len(last["session_id"]) == 12
    assert not any("secret" in line for line in lines)


def test_sglang_endpoints(server):
    info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
    # the served name, not the filesystem path (the operator exposes it with --expose-model-path)
    assert info["model_path"] == server.state.engine.name and info["is_generation"] is True
    assert str(server.model_dir) not in json.dumps(info)
    assert httpx.get(f"{server.url}/server_info", timeout=10).json() == info
    model_info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert model_info["is_generation"] is True and model_info["model_path"] == server.state.engine.name
    assert httpx.get(f"{server.url}/model_info", timeout=10).status_code == 200
    out = httpx.post(f"{server.url}/generate", timeout=30, json={
        "text": "Once upon", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) <= 3
    ids = server.state.engine.tokenizer.encode("Once upon")
    by_ids = httpx.post(f"{server.url}/generate", timeout=30, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert by_ids["output_ids"] == out["output_ids"]
    with httpx.stream("POST", f"{server.url}/generate", timeout=30, json={
            "text": "Once upon", "stream": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == out["text"]
    assert httpx.post(f"{server.url}/flush_cache", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/readiness", timeout=30).status_code == 200


def test_metrics_exposition(server, client):
    client.completions.create(model=client_model(client), prompt="metrics", max_tokens=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("kvsplice_requests_total", "kvsplice_prompt_tokens_total", "kvsplice_generation_tokens_total",
                 "kvsplice_time_to_first_token_seconds_bucket", "kvsplice_kv_slots_in_use", "kvsplice_kv_slots_free",
                 "kvsplice_kv_slots_cached", "kvsplice_num_requests_running", "kvsplice_num_requests_waiting",
                 "kvsplice_prefix_cache_hit_ratio", "kvsplice_prefix_tokens_total", "kvsplice_relocated_tokens_total",
                 "kvsplice_prefilled_tokens_total", "kvsplice_relocated_spans_total", "kvsplice_decode_arena_bytes",
                 "kvsplice_compiled_decode_steps_total", "kvsplice_compiled_decode_fallbacks_total"):
        assert name in text, name
    assert server.metric("kvsplice_prompt_tokens_total") > 0
    assert server.metric("kvsplice_decode_arena_bytes") > 0   # the second token was decoded over the arena
