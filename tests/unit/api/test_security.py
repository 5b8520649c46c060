"""API keys and the body-size limit, on a minimal FastAPI app with the ingress's middleware."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from sessionserve.api.security import (
    KEYS_ENV,
    ApiKeyMiddleware,
    BodySizeMiddleware,
    configure,
    load_api_keys,
    owner_of,
)
from sessionserve.errors import InvalidConfigError


def make_client(keys: tuple[str, ...], max_body: int = 2048) -> TestClient:
    app = FastAPI()
    app.add_middleware(BodySizeMiddleware)
    app.add_middleware(ApiKeyMiddleware)
    configure(app, keys, max_body)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        return {"owner": getattr(request.state, "owner", None), "bytes": len(body)}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return TestClient(app)


def test_keys_come_from_the_environment_and_a_file(tmp_path, monkeypatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nfile-key-1\n\nfile-key-2  # ci\nenv-key\n")
    monkeypatch.setenv(KEYS_ENV, " env-key, ,env-key-2")
    assert load_api_keys(str(keys_file)) == ("env-key", "env-key-2", "file-key-1", "file-key-2")
    monkeypatch.delenv(KEYS_ENV)
    assert load_api_keys(None) == ()  # no keys: the API is open
    with pytest.raises(InvalidConfigError, match="api_keys_file"):
        load_api_keys(str(tmp_path / "missing"))


def test_without_keys_everything_is_open() -> None:
    r = make_client(()).post("/v1/echo", content=b"x")
    assert r.status_code == 200 and r.json() == {"owner": None, "bytes": 1}


@pytest.mark.parametrize(
    "header", [None, "Bearer wrong", "Bearer ", "Basic a2V5LWE=", "key-a", "Bearer key-a-longer"]
)
def test_a_missing_or_wrong_key_is_a_401_with_the_error_body(header) -> None:
    client = make_client(("key-a", "key-b"))
    r = client.post("/v1/echo", headers={"authorization": header} if header else {})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert "key-a" not in r.text  # the body names no key
    assert client.get("/health").status_code == 200  # outside /v1: open


def test_each_key_owns_under_its_fingerprint() -> None:
    client = make_client(("key-a", "key-b"))
    a = client.post("/v1/echo", headers={"authorization": "Bearer key-a"}).json()["owner"]
    b = client.post("/v1/echo", headers={"authorization": "bearer key-b"}).json()["owner"]
    assert a == owner_of("key-a") != b == owner_of("key-b")
    assert "key-a" not in a  # a fingerprint, not the key


def test_an_oversized_body_is_a_413_whether_or_not_its_length_is_declared() -> None:
    client = make_client((), max_body=2048)
    assert client.post("/v1/echo", content=b"x" * 2048).json()["bytes"] == 2048
    declared = client.post("/v1/echo", content=b"x" * 2049)
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"x" * 1000

    streamed = client.post("/v1/echo", content=chunks())
    assert streamed.status_code == 413
