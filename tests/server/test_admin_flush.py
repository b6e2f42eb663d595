"""POST /flush_cache and the operator key: the admin key flushes every tenant's cache, a tenant key
its own namespaces only (pool and sessions), a missing or wrong key is a 401 with OpenAI's body,
and a web page is refused with a 403; a server without any key flushes everything, as before."""

from __future__ import annotations

import httpx
import pytest

from kvsplice.server.auth import ADMIN_KEY_ENV, API_KEY_ENV, ApiKeys, owner_id
from tests.server.conftest import assert_idle_without_leak, engine_call, start_server

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-fedcba9876543210"
ADMIN = "sk-operator-00112233445566778899"
PROMPT = {"prompt": "the same words from every tenant, long enough to cache", "max_tokens": 4,
          "temperature": 0, "ignore_eos": True}


def test_admin_key_comes_from_the_flag_else_the_environment():
    assert ApiKeys.from_sources(None, {ADMIN_KEY_ENV: " op "}).admin_key == "op"
    assert ApiKeys.from_sources(None, {ADMIN_KEY_ENV: "op"}, "flag").admin_key == "flag"
    assert ApiKeys.from_sources(None, {ADMIN_KEY_ENV: "  "}).admin_key is None
    keys = ApiKeys.from_sources(None, {API_KEY_ENV: "t1", ADMIN_KEY_ENV: "op"})
    assert keys.keys == ("t1",) and "op" not in repr(keys)
    assert keys.is_admin("op") and not keys.is_admin("t1") and not keys.is_admin(None)
    assert keys.owner_of_key("op") == owner_id("op")          # the admin key is a tenant of its own elsewhere
    for bad in (("t1", "t1"), ("t1", ""), ("t1", "a,b")):
        with pytest.raises(ValueError):
            ApiKeys((bad[0],), bad[1])


@pytest.fixture(scope="module")
def admin_server(tiny_model_dir):
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((KEY_A, KEY_B), ADMIN)},
                           num_slots=4096, max_batch_tokens=512)
    yield running
    running.thread.stop()


def _complete(server, key: str) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json={**PROMPT, "model": server.state.model_name},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _owners(server) -> set:
    engine = server.state.engine
    return engine_call(server, lambda: {ns.owner for ns in engine.cache.radix.namespaces()})


def _flush(server, headers: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/flush_cache", headers=headers, timeout=30)


def test_a_tenant_flushes_its_own_cache_only(admin_server):
    for key in (KEY_A, KEY_B):
        _complete(admin_server, key)
    assert_idle_without_leak(admin_server)
    assert _owners(admin_server) >= {owner_id(KEY_A), owner_id(KEY_B)}
    response = _flush(admin_server, {"Authorization": f"Bearer {KEY_A}"})
    assert response.status_code == 200 and "this tenant" in response.json()["message"]
    owners = _owners(admin_server)
    assert owner_id(KEY_A) not in owners and owner_id(KEY_B) in owners
    # x-api-key (Anthropic clients) names the tenant as well
    assert _flush(admin_server, {"x-api-key": KEY_B}).status_code == 200
    assert owner_id(KEY_B) not in _owners(admin_server)


def test_the_admin_key_flushes_every_tenant(admin_server):
    for key in (KEY_A, KEY_B, ADMIN):
        _complete(admin_server, key)
    assert_idle_without_leak(admin_server)
    response = _flush(admin_server, {"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 200 and "every tenant" in response.json()["message"]
    assert _owners(admin_server) == set()
    engine = admin_server.state.engine
    assert engine_call(admin_server, lambda: engine.cache.radix.cached_size()) == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN},
                                     {"x-api-key": "wrong"}])
def test_a_missing_or_wrong_key_is_a_401(admin_server, headers):
    response = _flush(admin_server, headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert error["type"] == "authentication_error"


def test_a_web_page_is_refused_with_a_403_even_with_the_admin_key(admin_server):
    response = _flush(admin_server, {"Authorization": f"Bearer {ADMIN}", "Origin": "https://evil.example"})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "browser_request"


@pytest.fixture(scope="module")
def operator_only_server(tiny_model_dir):
    """An admin key but no tenant keys: inference is open, the operator route is not."""
    running = start_server(tiny_model_dir, settings_kwargs={"api_keys": ApiKeys((), ADMIN)},
                           num_slots=2048, max_batch_tokens=512)
    yield running
    running.thread.stop()


def test_with_only_an_admin_key_flush_needs_it(operator_only_server):
    server = operator_only_server
    response = httpx.post(f"{server.url}/v1/completions", json={**PROMPT, "model": server.state.model_name},
                          timeout=60)
    assert response.status_code == 200
    assert_idle_without_leak(server)
    refused = _flush(server, {})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert _flush(server, {"Authorization": "Bearer wrong"}).status_code == 401
    assert _owners(server) == {None}
    assert _flush(server, {"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert _owners(server) == set()
