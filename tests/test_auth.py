"""API keys stored hashed in a real Redis; the read and admin scopes on routes."""

from __future__ import annotations

import hashlib
import re
import socket
import time
from typing import Annotated

import pytest
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import SecretStr

from models.errors import SphereFaceError
from service.auth import (
    ApiKeyInfo,
    Principal,
    authenticate,
    create_key,
    list_keys,
    parse_key,
    require_admin,
    require_read,
    revoke_key,
)
from service.errors import InvalidApiKeyError, MissingApiKeyError, RedisUnavailableError, error_response
from service.settings import Settings

ENV_KEY = "an-admin-key-from-the-environment"


def make_app(client: redis.Redis | None, **settings) -> FastAPI:
    app = FastAPI()
    app.state.settings = Settings(**{"api_key": SecretStr(ENV_KEY), **settings})
    app.state.redis = client

    @app.get("/v1/subjects")
    def read_gallery(principal: Annotated[Principal, Depends(require_read)], request: Request) -> dict:
        assert request.state.principal == principal
        return {"key_id": principal.key_id, "scope": principal.scope}

    @app.delete("/v1/subjects/{subject_id}")
    def change_gallery(
        subject_id: str, principal: Annotated[Principal, Depends(require_admin)], request: Request
    ) -> dict:
        assert request.state.principal == principal
        return {"key_id": principal.key_id, "deleted": subject_id}

    @app.exception_handler(SphereFaceError)
    async def domain_error(_: Request, exc: SphereFaceError) -> JSONResponse:
        return error_response(exc)

    return app


def call(client: TestClient, key: str | None, method: str = "GET", path: str = "/v1/subjects"):
    headers = {} if key is None else {"X-API-Key": key}
    return client.request(method, path, headers=headers)


def admin_call(client: TestClient, key: str | None):
    return call(client, key, "DELETE", "/v1/subjects/alice")


# -- storage --------------------------------------------------------------------------------


def test_create_list_revoke(redis_client: redis.Redis) -> None:
    read_key, read_info = create_key(redis_client, "read", name="kiosk")
    admin_key, admin_info = create_key(redis_client, "admin")
    assert re.fullmatch(r"sfk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", read_key)
    assert parse_key(read_key) == read_info.key_id
    assert read_info.scope == "read" and read_info.name == "kiosk"
    assert admin_info.scope == "admin" and admin_info.name == ""
    created = time.strptime(read_info.created_at, "%Y-%m-%dT%H:%M:%S+00:00")
    assert abs(time.mktime(created) - time.mktime(time.gmtime())) < 60

    listed = list_keys(redis_client)
    assert sorted(k.key_id for k in listed) == sorted([read_info.key_id, admin_info.key_id])
    assert all(isinstance(k, ApiKeyInfo) for k in listed)
    assert {k.key_id: k for k in listed}[read_info.key_id] == read_info
    assert not hasattr(listed[0], "hash")

    assert revoke_key(redis_client, read_info.key_id) is True  # by id
    assert revoke_key(redis_client, read_info.key_id) is False
    assert revoke_key(redis_client, admin_key) is True  # by the full key
    assert revoke_key(redis_client, "nonsense") is False
    assert revoke_key(redis_client, "0123456789ab") is False
    assert list_keys(redis_client) == []
    assert redis_client.keys("sf:*") == []


def test_redis_layout_and_prefix(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "admin", name="ops", prefix="other:")
    assert redis_client.smembers("other:apikeys") == {info.key_id.encode()}
    record = redis_client.hgetall(f"other:apikey:{info.key_id}")
    assert set(record) == {b"hash", b"scope", b"name", b"created_at"}
    assert record[b"hash"] == hashlib.sha256(key.encode()).hexdigest().encode()
    assert record[b"scope"] == b"admin" and record[b"name"] == b"ops"
    assert list_keys(redis_client) == []  # another prefix
    assert list_keys(redis_client, prefix="other:") == [info]
    assert authenticate(redis_client, key, env_key=None, prefix="other:") == Principal(info.key_id, "admin")
    with pytest.raises(InvalidApiKeyError):
        authenticate(redis_client, key, env_key=None)  # default prefix sf:


def test_only_the_hash_is_stored(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "admin", name="secret-holder")
    secret = key.split("_", 2)[2]
    stored = []
    for name in redis_client.scan_iter("*"):
        kind = redis_client.type(name)
        if kind == b"hash":
            stored.extend(redis_client.hgetall(name).values())
            stored.extend(redis_client.hgetall(name).keys())
        elif kind == b"set":
            stored.extend(redis_client.smembers(name))
        elif kind == b"string":
            stored.append(redis_client.get(name))
        else:
            raise AssertionError(f"unexpected Redis type {kind!r} of {name!r}")
        stored.append(name)
    assert stored
    blob = b"\n".join(stored)
    assert secret.encode() not in blob
    assert key.encode() not in blob
    assert info.key_id.encode() in blob


def test_invalid_scope_is_a_value_error(redis_client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="scope 'write'.*read, admin"):
        create_key(redis_client, "write")
    assert list_keys(redis_client) == []


def test_authenticate_errors(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "read")
    assert authenticate(redis_client, key, env_key=None) == Principal(info.key_id, "read")
    assert authenticate(redis_client, ENV_KEY, env_key=ENV_KEY) == Principal("env", "admin")
    for missing in (None, "", "   "):
        with pytest.raises(MissingApiKeyError, match="X-API-Key"):
            authenticate(redis_client, missing, env_key=ENV_KEY)
    wrong_secret = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for bad in ("garbage", "sfk_nothex123456_" + "x" * 43, wrong_secret, ENV_KEY + "x"):
        with pytest.raises(InvalidApiKeyError) as caught:
            authenticate(redis_client, bad, env_key=ENV_KEY)
        assert bad not in caught.value.message
    with pytest.raises(InvalidApiKeyError) as caught:
        authenticate(redis_client, wrong_secret, env_key=None)
    assert key.split("_", 2)[2] not in caught.value.message


# -- routes ---------------------------------------------------------------------------------


def test_read_key_reads_but_cannot_change(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "read")
    client = TestClient(make_app(redis_client))
    response = call(client, key)
    assert response.status_code == 200
    assert response.json() == {"key_id": info.key_id, "scope": "read"}
    response = admin_call(client, key)
    assert response.status_code == 403
    assert response.json()["code"] == "insufficient_scope"
    assert "'admin'" in response.json()["message"]


def test_admin_key_reads_and_changes(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "admin")
    client = TestClient(make_app(redis_client))
    assert call(client, key).json() == {"key_id": info.key_id, "scope": "admin"}
    response = admin_call(client, key)
    assert response.status_code == 200
    assert response.json() == {"key_id": info.key_id, "deleted": "alice"}


def test_env_key_is_an_admin_key(redis_client: redis.Redis) -> None:
    client = TestClient(make_app(redis_client))
    assert call(client, ENV_KEY).json() == {"key_id": "env", "scope": "admin"}
    assert admin_call(client, ENV_KEY).status_code == 200
    # without an env key configured the same string is just a malformed key
    client = TestClient(make_app(redis_client, api_key=None))
    assert call(client, ENV_KEY).json()["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("key", "status", "code"),
    [
        (None, 401, "missing_api_key"),
        ("", 401, "missing_api_key"),
        ("not-a-key", 401, "invalid_api_key"),
        ("sfk_0123456789ab_" + "A" * 43, 401, "invalid_api_key"),  # well formed, unknown
    ],
)
def test_missing_malformed_unknown(
    redis_client: redis.Redis, key: str | None, status: int, code: str
) -> None:
    client = TestClient(make_app(redis_client))
    for response in (call(client, key), admin_call(client, key)):
        assert response.status_code == status
        assert response.json()["code"] == code
        if key:
            assert key not in response.json()["message"]
        if code == "missing_api_key":
            assert "X-API-Key" in response.json()["message"]


def test_revoked_key_is_rejected(redis_client: redis.Redis) -> None:
    key, info = create_key(redis_client, "admin")
    client = TestClient(make_app(redis_client))
    assert call(client, key).status_code == 200
    assert revoke_key(redis_client, info.key_id)
    response = call(client, key)
    assert response.status_code == 401
    assert response.json()["code"] == "invalid_api_key"
    assert key not in response.json()["message"]


def test_auth_off_lets_everything_through() -> None:
    client = TestClient(make_app(None, auth="off", api_key=None))
    assert call(client, None).json() == {"key_id": "auth-off", "scope": "admin"}
    assert admin_call(client, "whatever").json() == {"key_id": "auth-off", "deleted": "alice"}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_is_503() -> None:
    down = redis.Redis(host="127.0.0.1", port=closed_port(), socket_connect_timeout=1, retry=None)
    client = TestClient(make_app(down))
    key = "sfk_0123456789ab_" + "A" * 43
    for response in (call(client, key), admin_call(client, key)):
        assert response.status_code == 503
        assert response.json()["code"] == "redis_unavailable"
        message = response.json()["message"]
        assert message.startswith("the gallery's Redis cannot be reached")
        assert key not in message and "127.0.0.1" not in message  # no key, no server address
    # the env key needs no Redis
    assert call(client, ENV_KEY).status_code == 200
    for action in (lambda: create_key(down, "read"), lambda: list_keys(down), lambda: revoke_key(down, key)):
        with pytest.raises(RedisUnavailableError):
            action()


def test_openapi_shows_the_api_key_scheme(redis_client: redis.Redis) -> None:
    schema = TestClient(make_app(redis_client)).get("/openapi.json").json()
    scheme = schema["components"]["securitySchemes"]["ApiKey"]
    assert scheme == {**scheme, "type": "apiKey", "in": "header", "name": "X-API-Key"}
    assert schema["paths"]["/v1/subjects"]["get"]["security"] == [{"ApiKey": []}]


def test_redis_stopping_mid_service_is_503(redis_server, redis_client: redis.Redis) -> None:
    key, _ = create_key(redis_client, "read")
    client = TestClient(make_app(redis_client))
    assert call(client, key).status_code == 200
    redis_server.stop()
    response = call(client, key)
    assert response.status_code == 503
    assert response.json()["code"] == "redis_unavailable"
