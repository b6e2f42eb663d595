"""API keys: who may use the server, and which tenant (cache owner) each request belongs to.

    request ─> path open (health probes, /metrics, /get_load, the OpenAPI document)?  pass, owner None
           ─> no keys configured?                                                      pass, owner None
           ─> Authorization: Bearer <key> (or x-api-key: <key>), a configured key?    pass, owner = owner_id(key)
           ─> else                                                                     401, OpenAI body

As in vLLM (`--api-key`, VLLM_API_KEY, `Authorization: Bearer`), with two differences: every route that
serves the model or changes its state needs the key, not only /v1/* (kvsplice also serves /generate,
/flush_cache and /get_server_info), and several keys may be given. Each key is a tenant: its requests
carry `owner = owner_id(key)` to the engine, whose cache namespace is (owner, cache_salt), so two keys
never share a prefix, a session or relocated K/V. The presented key's SHA-256 is compared in constant
time (hmac.compare_digest) with every configured key's, so the time taken says nothing about which key
nearly matched, nor about the keys' lengths.

The operator key (`--admin-api-key`, KVSPLICE_ADMIN_API_KEY) is for the operator routes (POST /flush_cache):
who may drop which cache (`flush_owner`):

    admin key configured?  caller                     POST /flush_cache drops
    yes                    the admin key              every tenant's cache (pool, sessions, disk tier)
    yes                    a tenant key               that tenant's own (every cache_salt it used)
    yes                    no key / a wrong key       nothing: 401
    no, tenant keys only   a tenant key               that tenant's own
    no key at all          anyone                     everything (no authentication, as before)

The admin key is accepted on every other route too, as one more tenant (its own namespace). It is
compared as the tenant keys are, in constant time.

`owner_id` is a stable, non-secret name of a key (a prefix of its SHA-256), safe to keep in memory and
logs; it is not a way back to the key as long as keys are long random strings.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvsplice.server.errors import ApiError, error_body

API_KEY_ENV = "KVSPLICE_API_KEY"
ADMIN_KEY_ENV = "KVSPLICE_ADMIN_API_KEY"
# Routes anyone may call: liveness / readiness probes (load balancers and sglang-router send no key
# to them), Prometheus metrics and the router's load poll (aggregate numbers, open as in vLLM), and the
# API's own description.
OPEN_PATHS = frozenset({"/health", "/readiness", "/health_generate", "/metrics", "/get_load",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
OWNER_STATE_KEY = "kvsplice_owner"
ADMIN_STATE_KEY = "kvsplice_admin"
OWNER_ID_HEX_CHARS = 16


def owner_id(key: str) -> str:
    """The tenant id of an API key: the first 16 hex characters of its SHA-256."""
    return _digest(key).hex()[:OWNER_ID_HEX_CHARS]


def _digest(key: str) -> bytes:
    """SHA-256 of the key's UTF-8 bytes (surrogates, which os.environ uses for undecodable bytes, pass)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_key_list(raw: str) -> tuple[str, ...]:
    """Keys from a comma-separated string (the KVSPLICE_API_KEY format); blanks around keys are dropped."""
    return tuple(key.strip() for key in raw.split(",") if key.strip())


@dataclass(frozen=True)
class ApiKeys:
    """The configured tenant keys (none: authentication is off) and the operator key (`admin_key`,
    None: no operator key). The repr never shows a key."""

    keys: tuple[str, ...] = field(default=(), repr=False)
    admin_key: Optional[str] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for key in self.keys + ((self.admin_key,) if self.admin_key is not None else ()):
            if not key or key != key.strip() or "," in key:
                raise ValueError("an API key must be non-empty, without surrounding blanks or commas")
        if self.admin_key is not None and self.admin_key in self.keys:
            raise ValueError("the admin API key must differ from every tenant API key")

    @classmethod
    def from_sources(cls, flag_keys: Optional[Iterable[str]], environ: Mapping[str, str],
                     admin_flag: Optional[str] = None) -> "ApiKeys":
        """Keys from `--api-key` flags when any are given, else from KVSPLICE_API_KEY (comma-separated);
        the admin key from `--admin-api-key`, else KVSPLICE_ADMIN_API_KEY (unset or blank: none)."""
        flags = tuple(flag_keys or ())
        admin = admin_flag if admin_flag is not None else (environ.get(ADMIN_KEY_ENV, "").strip() or None)
        return cls(flags if flags else parse_key_list(environ.get(API_KEY_ENV, "")), admin)

    @property
    def enabled(self) -> bool:
        """Whether every guarded route needs a key (tenant keys are configured)."""
        return bool(self.keys)

    def is_admin(self, presented: Optional[str]) -> bool:
        """Whether `presented` (a bare key) is the admin key (constant time)."""
        if self.admin_key is None or not presented:
            return False
        return hmac.compare_digest(_digest(presented), _digest(self.admin_key))

    def owner_of(self, authorization: Optional[str]) -> Optional[str]:
        """owner_id of the key in an `Authorization: Bearer <key>` header value, or None when it names
        no configured key (the admin key included). Every configured key is compared, in constant time."""
        return self.owner_of_key(bearer_key(authorization))

    def owner_of_key(self, presented: Optional[str]) -> Optional[str]:
        """owner_id of `presented` (a bare key, as Anthropic clients send it in `x-api-key`), or None."""
        if not presented:
            return None
        presented_digest = _digest(presented)
        match = None
        for key in self.keys + ((self.admin_key,) if self.admin_key is not None else ()):
            if hmac.compare_digest(presented_digest, _digest(key)):
                match = key
        return owner_id(match) if match is not None else None


def bearer_key(authorization: Optional[str]) -> Optional[str]:
    """The key of an `Authorization: Bearer <key>` header value (None for another scheme or none)."""
    if not authorization:
        return None
    scheme, _, presented = authorization.partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else None


def presented_keys(request: Request) -> tuple[str, ...]:
    """The keys a request carries: its bearer key and its `x-api-key`, where given."""
    return tuple(key for key in (bearer_key(request.headers.get("authorization")), request.headers.get("x-api-key"))
                 if key)


def request_owner(request: Request) -> Optional[str]:
    """The tenant the authentication middleware found for `request` (None without keys)."""
    return request.scope.get("state", {}).get(OWNER_STATE_KEY)


def flush_owner(request: Request, keys: ApiKeys) -> Optional[str]:
    """Whose cache an operator route (POST /flush_cache) acts on: None for every tenant's (the
    request carries the admin key, or the server has no key of any kind), else the caller's own
    tenant (see the module's table). ApiError 401 when an admin key is configured and the request
    carries neither it nor a tenant key."""
    presented = presented_keys(request)
    if any(keys.is_admin(key) for key in presented):
        return None
    owner = request_owner(request) or next(filter(None, map(keys.owner_of_key, presented)), None)
    if owner is not None:
        return owner
    if keys.admin_key is None and not keys.enabled:
        return None
    raise ApiError(401, "this route needs the admin API key or a tenant API key: send `Authorization: Bearer <key>`",
                   error_type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class AuthMiddleware:
    """ASGI middleware: refuses (401) HTTP requests to routes outside OPEN_PATHS that lack a configured
    key, before their body is read; records the key's owner in the request state for the handlers.
    `on_refuse(status)` is called for each refusal (metrics)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, on_refuse=lambda status: None):
        self.app, self.keys, self.on_refuse = app, keys, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        owner = next(filter(None, map(self.keys.owner_of_key, presented_keys(request))), None)
        if owner is None:
            self.on_refuse(401)
            response = _unauthorized("authorization" in request.headers or "x-api-key" in request.headers)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[OWNER_STATE_KEY] = owner
        await self.app(scope, receive, send)


def _unauthorized(had_header: bool) -> JSONResponse:
    what = "wrong API key" if had_header else "missing API key"
    body: dict[str, Any] = error_body(f"{what}: send `Authorization: Bearer <key>` with a key this server accepts",
                                      "authentication_error", code="invalid_api_key")
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def refuse_browser_request(request: Request) -> None:
    """ApiError 403 for a request that carries an Origin header (browsers add one to every
    cross-origin POST). Admin routes call it: without an API key, a web page the operator opens could
    otherwise POST /flush_cache with a plain form or fetch, which needs no CORS preflight.
    sglang-router, curl and SDKs send no Origin."""
    if "origin" in request.headers:
        raise ApiError(403, "admin routes do not accept requests from a web page (Origin header present)",
                       error_type="permission_error", code="browser_request")
