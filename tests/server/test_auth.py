"""API keys and tenants: every route but the open probes refuses a missing or wrong key with 401 and
OpenAI's body; each key is a tenant whose prefixes, sessions and relocated K/V no other key can reach,
even with the same prompt and the same session_id."""

from __future__ import annotations

import httpx
import pytest

from kvsplice.server.api import ServerSettings
from kvsplice.server.auth import API_KEY_ENV, OPEN_PATHS, ApiKeys, owner_id
from kvsplice.server.launch import exposure_warning, is_loopback
from tests.server.conftest import assert_idle_without_leak, start_server
from tests.server.test_scr_e2e import FIRST_TURN, SMALL_PROMPT_SCR, reuse_of, second_turn

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-fedcba9876543210"
KEY_C = "sk-tenant-c-00112233445566778899"


def test_owner_id_is_a_stable_short_hash():
    assert owner_id(KEY_A) == owner_id(KEY_A) != owner_id(KEY_B)
    assert len(owner_id(KEY_A)) == 16 and int(owner_id(KEY_A), 16) >= 0
    assert KEY_A not in owner_id(KEY_A)


def test_keys_come_from_flags_else_the_environment():
    assert ApiKeys.from_sources(["k1", "k2"], {API_KEY_ENV: "e1"}).keys == ("k1", "k2")
    assert ApiKeys.from_sources(None, {API_KEY_ENV: " e1 , e2,,"}).keys == ("e1", "e2")
    assert not ApiKeys.from_sources(None, {}).enabled
    with pytest.raises(ValueError):
        ApiKeys(("a,b",))
    with pytest.raises(ValueError):
        ApiKeys(("",))
    assert "k1" not in repr(ApiKeys(("k1",))) and "k1" not in repr(ServerSettings(api_keys=ApiKeys(("k1",))))


@pytest.mark.parametrize("header, owner", [
    (f"Bearer {KEY_A}", owner_id(KEY_A)),
    (f"bearer {KEY_B}", owner_id(KEY_B)),
    (None, None),
    ("", None),
    (f"Basic {KEY_A}", None),
    (f"Bearer {KEY_A}x", None),
    (f"Bearer {KEY_A[:-1]}", None),
    ("Bearer ", None),
    (KEY_A, None),
])
def test_owner_of_a_header(header, owner):
    assert ApiKeys((KEY_A, KEY_B)).owner_of(header) == owner


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("10.0.0.5", False), ("myhost.example", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) == loopback


def test_exposure_warning_without_a_key_beyond_loopback():
    warning = exposure_warning(ServerSettings(host="0.0.0.0", port=8000))
    assert warning and "0.0.0.0:8000" in warning and "KVSPLICE_API_KEY" in warning
    assert exposure_warning(ServerSettings(host="0.0.0.0", port=8000, api_keys=ApiKeys((KEY_A,)))) is None
    assert exposure_warning(ServerSettings(host="127.0.0.1", port=8000)) is None


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    """Two tenants' keys; SCR tuned for the small test prompts (as in test_scr_e2e)."""
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((KEY_A, KEY_B, KEY_C))},
                           num_slots=8192, max_batch_tokens=512, reuse=SMALL_PROMPT_SCR)
    yield running
    running.thread.stop()


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app: the app's own (including the ones FastAPI adds: OpenAPI,
    docs) and those of included routers, which the OpenAPI document lists (a path parameter becomes "x")."""
    own = {(method, route.path) for route in app.routes if hasattr(route, "methods") for method in route.methods}
    documented = {(method.upper(), path.replace("{model_id}", "x")) for path, methods in app.openapi()["paths"].items()
                  for method in methods}
    return sorted(own | documented)


def test_every_route_but_the_open_ones_needs_a_key(keyed_server):
    routes = _routes(keyed_server.app)
    guarded = [(method, path) for method, path in routes if path not in OPEN_PATHS]
    assert ("POST", "/v1/chat/completions") in guarded and ("POST", "/flush_cache") in guarded
    assert {path for _, path in guarded} >= {"/v1/models", "/v1/models/x", "/generate", "/get_server_info",
                                             "/get_model_info", "/tokenize", "/detokenize", "/version"}
    for method, path in guarded + [("GET", "/no/such/route"), ("GET", "/flush_cache")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
            response = httpx.request(method, f"{keyed_server.url}{path}", headers=headers, timeout=10)
            assert response.status_code == 401, (method, path, headers, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"


def test_open_routes_answer_without_a_key(keyed_server):
    for method, path in (("GET", "/health"), ("HEAD", "/health"), ("GET", "/readiness"), ("GET", "/metrics"),
                         ("GET", "/get_load"), ("GET", "/openapi.json")):
        assert httpx.request(method, f"{keyed_server.url}{path}", timeout=30).status_code == 200, path


def test_a_key_opens_the_routes(keyed_server):
    auth = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.get(f"{keyed_server.url}/v1/models", headers=auth, timeout=10).status_code == 200
    info = httpx.get(f"{keyed_server.url}/get_server_info", headers=auth, timeout=10)
    assert info.status_code == 200 and str(keyed_server.model_dir) not in info.text
    assert httpx.get(f"{keyed_server.url}/flush_cache", headers=auth, timeout=10).status_code == 405
    assert httpx.post(f"{keyed_server.url}/flush_cache", headers=auth, timeout=10).status_code == 200


def _client(server, key: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _turn(client, messages, **extra_body):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True, **extra_body})


def test_tenants_never_share_prefixes_sessions_or_relocated_kv(keyed_server):
    tenant_a, tenant_b, tenant_c = (_client(keyed_server, key) for key in (KEY_A, KEY_B, KEY_C))
    first = _turn(tenant_a, FIRST_TURN, session_id="conv-a")
    assert reuse_of(first.usage)["session"] == "new"
    edited = second_turn(first.choices[0].message.content)

    # B knows A's session id and sends A's next prompt: nothing of A's conversation comes back.
    stolen = reuse_of(_turn(tenant_b, edited, session_id="conv-a").usage)
    assert stolen["prefix_tokens"] == 0 and stolen["relocated_tokens"] == 0 and stolen["session"] == "new"
    # Nor from A's first prompt, sent again word for word by a third tenant (A's exact prefix is in the
    # radix tree; B's own request above shares its first messages, so C asks).
    repeat = reuse_of(_turn(tenant_c, FIRST_TURN).usage)
    assert repeat["prefix_tokens"] == 0 and repeat["relocated_tokens"] == 0

    # A's own conversation is intact: its next turn matches its session and relocates around the edit.
    own = reuse_of(_turn(tenant_a, edited, session_id="conv-a").usage)
    assert own["session"] == "matched" and own["relocated_tokens"] > 0 and own["prefix_tokens"] > 0
    # Within one key the prefix is shared (the control: the refusals above are the tenant boundary).
    assert reuse_of(_turn(tenant_a, FIRST_TURN).usage)["prefix_tokens"] > 0
    assert_idle_without_leak(keyed_server)
