"""Session matching through HTTP, as a client without session ids sees it: a turn that edits the start
of its conversation (the system prompt's first sentence, stripped reasoning blocks) still finds its
conversation and relocates; a new conversation that only shares the system prompt does not; a known
X-SMG-Routing-Key gives another conversation nothing and leaves its owner's K/V alone; /metrics counts
the misses by reason."""

from __future__ import annotations

import random
import re

import httpx
import pytest

from kvsplice.bench.workload import load_corpus, take_words
from kvsplice.reuse.config import ReuseConfig
from tests.server.conftest import start_server

REUSE = ReuseConfig(min_span=8, tail=4)  # default session-matching settings; short spans relocate
CORPUS = load_corpus()
SYSTEM_TAIL = ("You are a careful research agent. You read documentation with tools, keep short notes, and "
               "remove results you no longer need. Cite the module and function for every claim you make.")


def system(day: int) -> dict:
    return {"role": "system", "content": f"Session day {day}. {SYSTEM_TAIL}"}


def conversation(topic: str, day: int = 1, stripped: bool = False) -> list[dict]:
    """A system prompt, a task and three answered questions whose answers open with a reasoning block;
    the text (documentation words, drawn by topic) is the conversation's own."""
    rng = random.Random(topic)
    messages = [system(day), {"role": "user", "content": f"Task: explain {topic}. {take_words(rng, CORPUS, 30)[1]}"}]
    for step in range(3):
        thought = f"<think>{take_words(rng, CORPUS, 25)[1]}</think>"
        answer = take_words(rng, CORPUS, 40)[1]
        messages += [{"role": "assistant", "content": answer if stripped else thought + answer},
                     {"role": "user", "content": f"Now part {step + 1}: {take_words(rng, CORPUS, 15)[1]}"}]
    return messages


@pytest.fixture(scope="module")
def scr_server(tiny_model_dir):
    running = start_server(tiny_model_dir, num_slots=16384, max_batch_tokens=1024, reuse=REUSE)
    yield running
    running.thread.stop()


def chat(server, messages, headers=None, **extra):
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)
    assert response.status_code == 200, response.text
    reuse = response.json()["usage"]["reuse"]
    assert response.json()["usage"]["prompt_tokens"] == (reuse["prefix_tokens"] + reuse["relocated_tokens"]
                                                         + reuse["prefilled_tokens"])
    return reuse


def test_an_edit_at_the_start_finds_its_conversation_without_any_id(scr_server):
    first = chat(scr_server, conversation("the json module"), cache_salt="no-ids")
    assert (first["session"], first["fallback"]) == ("new", "no_candidate")
    other = chat(scr_server, conversation("the heapq module"), cache_salt="no-ids")
    # shares only the system prompt: too little evidence, or too little kept once verified
    assert other["session"] == "new" and other["fallback"] in ("no_candidate", "low_overlap")
    # the system prompt's first sentence changes (token 0 onwards) and every reasoning block is stripped
    edited = chat(scr_server, conversation("the json module", day=2, stripped=True), cache_salt="no-ids")
    assert edited["session"] == "matched" and edited["fallback"] is None
    assert edited["relocated_tokens"] > 100 and edited["prefix_tokens"] < 50  # the prefix ends at "day "


def test_a_known_routing_key_gives_another_conversation_nothing(scr_server):
    key = {"X-SMG-Routing-Key": "victim-chat"}
    chat(scr_server, conversation("the csv module"), headers=key)
    intruder = chat(scr_server, conversation("the zlib module"), headers=key)
    assert (intruder["session"], intruder["fallback"]) == ("new", "session_mismatch")
    assert intruder["relocated_tokens"] == 0
    victim = chat(scr_server, conversation("the csv module", day=5, stripped=True), headers=key)
    assert victim["session"] == "matched" and victim["relocated_tokens"] > 100
    metrics = httpx.get(f"{scr_server.url}/metrics", timeout=10).text  # misses are counted by reason
    counted = {match.group(1): float(match.group(2)) for match in
               re.finditer(r'^kvsplice_scr_fallbacks_total\{[^}]*reason="([a-z_]+)"[^}]*\} (\S+)$', metrics, re.M)}
    assert counted["session_mismatch"] == 1.0 and counted["new_session"] >= 1.0
