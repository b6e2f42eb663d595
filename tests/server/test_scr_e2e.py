"""Suffix Cache Reuse end to end: the real `openai` client against a real server on a tiny model.

An agent deletes a long tool result from the middle of its context; the tokens after it must come back
relocated (not prefilled), the usage identity must hold, and nothing may leak into another cache_salt,
into an `scr: "off"` request, or out of the KV pool once the server is idle.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvsplice.reuse.config import ReuseConfig
from tests.server.conftest import start_server

# The test prompts are a few hundred tokens: automatic session matching must accept them (the default
# match_min_tokens is 1024), and spans must be relocatable at this size (defaults: min_span 64, tail 16).
SMALL_PROMPT_SCR = ReuseConfig(match_min_tokens=32, min_span=8, tail=4)
REPLY = dict(max_tokens=8, temperature=0)

SYSTEM = {"role": "system", "content": "You are a careful research agent. Agents edit their own context: "
                                       "they delete tool results and rewrite notes in place. " * 3}
TASK = {"role": "user", "content": "Task: read the documentation and summarise it. "
                                   "The quick brown fox jumps over the lazy dog."}
CALL = {"role": "assistant", "content": "Reading the file.", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "read_doc", "arguments": "{\"name\": \"a.txt\"}"}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1",
               "content": "def main():\n    print('hello world')\n\n"
                          "The function returns None when nothing is found. " * 6}
NOTES = {"role": "user", "content": "Working notes: Once upon a time there was a little robot who liked to read "
                                    "documentation. Tool results are long; notes are short. " * 3}
FIRST_TURN = [SYSTEM, TASK, CALL, TOOL_RESULT, NOTES]


@pytest.fixture(scope="module")
def scr_server(tiny_model_dir):
    """A server of its own (SCR sessions hold KV slots, which the shared server's leak checks would see)."""
    running = start_server(tiny_model_dir, num_slots=8192, max_batch_tokens=512, reuse=SMALL_PROMPT_SCR)
    yield running
    running.thread.stop()


@pytest.fixture(scope="module")
def scr_client(scr_server):
    """A real `openai` client pointed at the SCR server."""
    from openai import OpenAI

    return OpenAI(base_url=f"{scr_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, messages, **extra_body):
    """One greedy, non-streamed chat turn that must produce text (ignore_eos: the random model may stop at once)."""
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                          extra_body={"ignore_eos": True, **extra_body}, **REPLY)


def reuse_of(usage) -> dict:
    """kvsplice's `usage.reuse`, after checking the identities every response must satisfy."""
    reuse = usage.model_extra["reuse"]
    assert usage.prompt_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"] + reuse["prefilled_tokens"]
    assert usage.prompt_tokens_details.cached_tokens == reuse["prefix_tokens"] + reuse["relocated_tokens"]
    breakdown = (reuse["changed"] + reuse["span_tails"] + reuse["unchosen_spans"] + reuse["uncached_unchanged"]
                 + reuse["recomputed"])
    assert breakdown == reuse["prefilled_tokens"]
    assert (reuse["relocated_spans"] > 0) == (reuse["relocated_tokens"] > 0)
    return reuse


def assert_plausible_reply(response) -> None:
    choice = response.choices[0]
    assert choice.message.content, "empty reply"
    assert choice.finish_reason == "length"  # ignore_eos: it runs to max_tokens
    assert response.usage.completion_tokens == REPLY["max_tokens"]


def second_turn(first_reply: str) -> list[dict]:
    """Turn 2: the call and its long result are deleted from the middle; a reply and a question appended."""
    return [SYSTEM, TASK, NOTES, {"role": "assistant", "content": first_reply},
            {"role": "user", "content": "Now continue with the next file."}]


def test_deleted_tool_result_relocates_the_rest_over_three_turns(scr_client):
    first = chat(scr_client, FIRST_TURN, cache_salt="three-turns")
    assert reuse_of(first.usage)["session"] == "new"
    assert_plausible_reply(first)

    messages = second_turn(first.choices[0].message.content)
    second = chat(scr_client, messages, cache_salt="three-turns")
    reuse = reuse_of(second.usage)
    assert reuse["session"] == "matched" and reuse["fallback"] is None
    assert reuse["relocated_tokens"] > 0
    # [SYSTEM][TASK] is the exact prefix; NOTES follows the deleted part, so it must be relocated, not prefilled.
    assert reuse["prefix_tokens"] > 0
    assert reuse["prefilled_tokens"] < second.usage.prompt_tokens - reuse["prefix_tokens"] - 100
    assert_plausible_reply(second)

    # Turn 3 only appends; streamed, so the usage chunk of the streaming path is checked too.
    messages = messages + [{"role": "assistant", "content": second.choices[0].message.content},
                           {"role": "user", "content": "And the one after it."}]
    stream = scr_client.chat.completions.create(
        model=scr_client.models.list().data[0].id, messages=messages, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "cache_salt": "three-turns"},
        **REPLY)
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert text and finish == ["length"]
    third = reuse_of(chunks[-1].usage)
    assert third["session"] == "matched"
    assert third["prefix_tokens"] + third["relocated_tokens"] > 0
    # Everything of turn 2 is reused (exactly or relocated); only the appended messages and tails are computed.
    assert third["prefix_tokens"] + third["relocated_tokens"] >= second.usage.prompt_tokens - 4 * SMALL_PROMPT_SCR.tail


def test_another_cache_salt_never_relocates(scr_client):
    first = chat(scr_client, FIRST_TURN, cache_salt="tenant-a")
    second = chat(scr_client, second_turn(first.choices[0].message.content), cache_salt="tenant-b")
    reuse = reuse_of(second.usage)
    assert reuse["relocated_tokens"] == 0 and reuse["prefix_tokens"] == 0
    assert reuse["session"] == "new"
    assert_plausible_reply(second)


def test_scr_off_per_request_relocates_nothing(scr_client):
    first = chat(scr_client, FIRST_TURN, cache_salt="scr-off")
    second = chat(scr_client, second_turn(first.choices[0].message.content), cache_salt="scr-off", scr="off")
    reuse = reuse_of(second.usage)
    assert reuse["session"] == "off"
    assert reuse["relocated_tokens"] == 0 and reuse["relocated_spans"] == 0
    assert reuse["prefix_tokens"] > 0  # the radix cache still serves the exact prefix
    assert_plausible_reply(second)


def wait_until_idle(server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric("kvsplice_num_requests_running") != 0 or server.metric("kvsplice_num_requests_waiting") != 0:
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)


def test_metrics_count_relocations_and_no_slot_leaks_when_idle(scr_client, scr_server):
    first = chat(scr_client, FIRST_TURN, cache_salt="metrics")
    before = scr_server.metric("kvsplice_relocated_tokens_total")
    second = chat(scr_client, second_turn(first.choices[0].message.content), cache_salt="metrics")
    relocated = reuse_of(second.usage)["relocated_tokens"]
    assert relocated > 0
    wait_until_idle(scr_server)
    assert scr_server.metric("kvsplice_relocated_tokens_total") == before + relocated > 0
    assert scr_server.metric("kvsplice_relocated_spans_total") > 0
    total = scr_server.metric("kvsplice_kv_slots_capacity")
    in_use = scr_server.metric("kvsplice_kv_slots_in_use")
    free, cached = scr_server.metric("kvsplice_kv_slots_free"), scr_server.metric("kvsplice_kv_slots_cached")
    # Idle: only SCR sessions hold slots (their private tails), and every slot is accounted for once.
    assert 0 < in_use < total and in_use + free + cached == total
    # Dropping idle sessions and the radix tree must give every slot back.
    assert httpx.post(f"{scr_server.url}/flush_cache", timeout=10).status_code == 200
    assert scr_server.metric("kvsplice_kv_slots_in_use") == 0
    assert scr_server.metric("kvsplice_kv_slots_free") == total
