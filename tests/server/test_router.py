"""kvsplice replicas behind the real sglang-router (pip install sglang-router==0.3.2; skipped without it).

Two in-process replicas of the tiny model (replica names r0, r1, /get_load installed), the router as a
subprocess on a free port. Conversations go through the router with the openai client; the replicas'
request logs say which replica served each request (hashed session id + replica name).
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from kvsplice.bench.scale_out import RouterOptions, healthy_workers, router_available, start_router, wait_until
from kvsplice.server.metrics import EngineSnapshot
from kvsplice.server.replica import has_route, install_router_routes, load_report
from kvsplice.server.request_log import session_hash
from tests.server.conftest import LineSink

pytestmark = pytest.mark.skipif(not router_available(), reason="sglang-router is not installed")

FILLER = "Tool results are long; notes are short. The quick brown fox jumps over the lazy dog. "


class Replica:
    """An in-process kvsplice server with its request log sink."""

    def __init__(self, model_dir: Path, name: str, **settings_kwargs):
        from kvsplice.config import EngineConfig
        from kvsplice.server.api import ServerSettings
        from kvsplice.server.launch import ServerThread, build_app
        from kvsplice.server.request_log import RequestLog

        self.name, self.sink = name, LineSink()
        config = EngineConfig(model=str(model_dir), num_slots=16384, max_batch_tokens=1024)
        self.app = build_app(config, ServerSettings(model_path=str(model_dir), replica_name=name, **settings_kwargs),
                             RequestLog(self.sink))
        install_router_routes(self.app)
        self.thread = ServerThread(self.app)
        self.thread.start()
        self.url = self.thread.url
        self.stopped = False

    def rids_served(self) -> set[str]:
        """Request ids this replica logged (the router passes them through as the response `id`)."""
        records = [json.loads(line.split(" ", 1)[1]) for line in self.sink.lines()
                   if line.startswith("kvsplice.request ")]
        return {record["rid"] for record in records}

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.thread.stop()


def _start_replicas(model_dir: Path, count: int) -> list[Replica]:
    replicas: list[Replica] = []
    try:
        for number in range(count):
            replicas.append(Replica(model_dir, f"r{number}"))
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    """Two replicas and a cache_aware router over them (shared by the non-destructive tests)."""
    replicas = _start_replicas(tiny_model_dir, 2)
    router = None
    try:
        router = start_router([r.url for r in replicas], RouterOptions(policy="cache_aware"),
                              log_path=tmp_path_factory.mktemp("router") / "router.log")
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def _client(router_url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _model(replicas: list[Replica]) -> str:
    """The model name the replicas serve (the tiny model's directory name)."""
    return replicas[0].app.state.kvsplice.engine.name


def _turn_messages(conversation: int, turn: int) -> list[dict]:
    """Turn `turn` of an agent conversation: a private system prompt, then one long tool result per turn;
    from turn 3 on, the first tool result is deleted (a mid-context edit that SCR relocates around)."""
    messages = [{"role": "system", "content": f"Agent {conversation} of the router test. " + FILLER * 4}]
    for step in range(turn + 1):
        messages.append({"role": "user", "content": f"Result {step} of agent {conversation}: " + FILLER * 6})
        messages.append({"role": "assistant", "content": f"Noted result {step}."})
    if turn >= 3:
        del messages[1:3]
    return messages[:-1]


def _ask(client, model: str, conversation: int, turn: int):
    return client.chat.completions.create(
        model=model, messages=_turn_messages(conversation, turn), max_tokens=4, temperature=0,
        extra_body={"session_id": f"conv-{conversation}"})


def test_load_report_has_sglang_shape():
    snapshot = EngineSnapshot(counters={}, num_running=2, num_waiting=3, slots_total=100, slots_in_use=40,
                              slots_free=50, slots_cached=10)
    assert load_report(snapshot) == [{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 3, "num_tokens": 40}]


def test_install_router_routes_is_idempotent(fleet):
    _, replicas = fleet
    app = replicas[0].app
    before = len(app.router.routes)
    install_router_routes(app)
    assert has_route(app, "/get_load") and len(app.router.routes) == before


def test_router_registers_replicas_and_reads_their_load(fleet):
    router, replicas = fleet
    workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r.url for r in replicas)
    assert all(w["model_id"] == _model(replicas) and w["is_healthy"] for w in workers)
    # The router's /get_loads calls every worker's /get_load; -1 means it could not read it.
    loads = httpx.get(f"{router.url}/get_loads", timeout=10).json()["workers"]
    assert len(loads) == 2 and all(entry["load"] >= 0 for entry in loads)
    assert httpx.get(f"{router.url}/get_model_info", timeout=10).json()["served_model_name"] == _model(replicas)


def test_cache_aware_keeps_conversations_on_one_replica_and_reuses(fleet):
    router, replicas = fleet
    client, model = _client(router.url), _model(replicas)
    n_conversations, n_turns = 4, 5
    reused: dict[int, list[int]] = defaultdict(list)
    rids: dict[int, set[str]] = defaultdict(set)
    for turn in range(n_turns):
        for conversation in range(n_conversations):
            response = _ask(client, model, conversation, turn)
            reuse = response.usage.model_extra["reuse"]
            reused[conversation].append(reuse["prefix_tokens"] + reuse["relocated_tokens"])
            rids[conversation].add(response.id)
    for conversation in range(n_conversations):
        assert all(tokens > 0 for tokens in reused[conversation][1:]), reused[conversation]
        owners = [r.name for r in replicas if rids[conversation] & r.rids_served()]
        assert len(owners) == 1, f"conversation {conversation} was served by {owners}"


def test_streaming_and_generate_pass_through_the_router(fleet):
    router, replicas = fleet
    chunks = list(_client(router.url).chat.completions.create(
        model=_model(replicas), messages=_turn_messages(9, 0), max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"session_id": "conv-9"}))
    assert chunks[-1].usage is not None and "reuse" in chunks[-1].usage.model_extra
    body = httpx.post(f"{router.url}/generate", timeout=30,
                      json={"text": FILLER, "sampling_params": {"max_new_tokens": 3}}).json()
    assert body["meta_info"]["completion_tokens"] == 3 and "reuse" in body["meta_info"]


def test_a_dead_replica_is_dropped_and_conversations_continue(tiny_model_dir, tmp_path):
    replicas = _start_replicas(tiny_model_dir, 2)
    router = None
    try:
        router = start_router([r.url for r in replicas], RouterOptions(policy="cache_aware"),
                              log_path=tmp_path / "router.log")
        client, model = _client(router.url), _model(replicas)
        n_conversations, n_turns, kill_after_turn = 4, 6, 2
        outcomes: dict[int, list[str]] = defaultdict(list)
        conversation_rids: dict[int, set[str]] = defaultdict(set)
        last_rid: dict[int, str] = {}
        reuse_after: dict[int, list[int]] = defaultdict(list)
        started_killing = threading.Barrier(n_conversations + 1)

        def run(conversation: int) -> None:
            for turn in range(n_turns):
                if turn == kill_after_turn:
                    started_killing.wait(timeout=60)  # these turns are sent while the replica dies
                try:
                    response = _ask(client, model, conversation, turn)
                    reuse = response.usage.model_extra["reuse"]
                    outcomes[conversation].append("ok")
                    conversation_rids[conversation].add(response.id)
                    if turn > kill_after_turn:
                        last_rid[conversation] = response.id
                        reuse_after[conversation].append(reuse["prefix_tokens"] + reuse["relocated_tokens"])
                except Exception as error:  # noqa: BLE001 - any failure is recorded and judged below
                    outcomes[conversation].append(f"{type(error).__name__}: {error}")

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(n_conversations)]
        for thread in threads:
            thread.start()
        started_killing.wait(timeout=60)
        # Kill the replica that served the most requests so far (sglang-router 0.3.2's cache_aware puts
        # conversations on one replica until the load is imbalanced).
        victim = max(replicas, key=lambda replica: len(replica.rids_served()))
        survivor = next(replica for replica in replicas if replica is not victim)
        victim_rids = victim.rids_served()
        victim.stop()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
        wait_until(lambda: healthy_workers(router.url) == [survivor.url], "dead replica dropped", 15)
        for conversation in range(n_conversations):
            results = outcomes[conversation]
            assert len(results) == n_turns
            # Only the request in flight while the replica died may fail; every later turn succeeds.
            assert results[kill_after_turn + 1:] == ["ok"] * (n_turns - kill_after_turn - 1), results
            # After the move the conversation warms up again on the survivor.
            assert reuse_after[conversation][-1] > 0, reuse_after[conversation]
        # Conversations that lived on the dead replica finished on the survivor. (A turn sent in the
        # instant the victim was shutting down may still have been served by it, gracefully; the
        # last turn of each, sent well after the router dropped it, cannot have been.)
        moved = [c for c in range(n_conversations) if conversation_rids[c] & victim_rids]
        assert moved, "no conversation was on the replica that died"
        assert all(last_rid[c] in survivor.rids_served() for c in moved)
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()


def test_request_session_id_prefers_body_then_routing_key_header():
    from kvsplice.server.replica import request_session_id

    assert request_session_id("body", {"x-smg-routing-key": "header"}) == "body"
    assert request_session_id(None, {"x-smg-routing-key": "header"}) == "header"
    assert request_session_id(None, {"x-smg-routing-key": ""}) is None
    assert request_session_id(None, {}) is None


def test_router_forwards_only_the_routing_key_header_and_drops_chat_session_id(fleet):
    """What the router does to kvsplice's extra fields (why `request_session_id` reads the header)."""
    router, replicas = fleet
    response = httpx.post(f"{router.url}/v1/chat/completions", timeout=30,
                          headers={"X-SMG-Routing-Key": "key-1", "X-Session-Id": "other"},
                          json={"model": _model(replicas), "messages": [{"role": "user", "content": FILLER}],
                                "max_tokens": 2, "session_id": "body-1"})
    assert response.status_code == 200
    rid = response.json()["id"]
    records = [json.loads(line.split(" ", 1)[1]) for r in replicas for line in r.sink.lines()
               if line.startswith("kvsplice.request ")]
    record = next(record for record in records if record["rid"] == rid)
    # The body's session_id never arrives; the header's does once api.py reads it (request_session_id).
    assert record["session_id"] in (None, session_hash("key-1")), record["session_id"]


def test_api_keys_keep_tenants_apart_behind_the_router(tiny_model_dir, tmp_path):
    """sglang-router forwards the client's Authorization header on inference routes, so a replica with
    API keys derives each request's owner from it and tenants keep their namespaces behind the router
    (while a chat body's cache_salt is dropped there: docs/SECURITY.md)."""
    from kvsplice.server.auth import ApiKeys

    keys = ("sk-router-tenant-a-0123456789", "sk-router-tenant-b-9876543210")
    replica = Replica(tiny_model_dir, "r0", api_keys=ApiKeys(keys))
    router = None
    try:
        # The replica refuses the router's keyless /server_info; the router registers it all the same.
        router = start_router([replica.url], RouterOptions(policy="round_robin"), log_path=tmp_path / "router.log")
        model = _model([replica])

        def prefix_tokens(key: str, **extra_body) -> int:
            from openai import OpenAI

            client = OpenAI(base_url=f"{router.url}/v1", api_key=key, max_retries=0, timeout=60)
            response = client.chat.completions.create(model=model, messages=_turn_messages(7, 0), max_tokens=2,
                                                      temperature=0, extra_body=extra_body)
            return response.usage.model_extra["reuse"]["prefix_tokens"]

        assert prefix_tokens(keys[0]) == 0
        assert prefix_tokens(keys[1]) == 0  # the other tenant: A's prefix is out of its reach
        assert prefix_tokens(keys[0]) > 0  # A itself reuses it
        assert prefix_tokens(keys[0], cache_salt="another-salt") > 0  # the router dropped the salt
        refused = httpx.post(f"{router.url}/v1/chat/completions", timeout=30,
                             json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 401
    finally:
        if router is not None:
            router.stop()
        replica.stop()
