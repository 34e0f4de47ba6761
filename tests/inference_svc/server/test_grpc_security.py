"""TLS (a self-signed certificate made in the test with the openssl CLI) and API keys (`authorization: Bearer KEY`,
UNAUTHENTICATED otherwise, health open, keys never logged)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from inference_svc.client import NO_RETRY, TandemClient
from inference_svc.grpc_service.auth import ApiKeyInterceptor
from tests.inference_svc.server.conftest import ServerThread, make_server

KEY = "tk-test-0123456789abcdef"
OTHER_KEY = "tk-second-key"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def secure_server(bundle_dir, tls_files, tmp_path_factory) -> Iterator[ServerThread]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# one key per line\n{KEY}\n\n{OTHER_KEY}\n")
    cert, key = tls_files
    srv = make_server(bundle_dir, tls_cert=str(cert), tls_key=str(key), api_key_file=str(keys))
    yield srv
    srv.close()


def _tls_client(srv: ServerThread, cert: Path, **kwargs) -> TandemClient:
    return TandemClient(srv.target, tls=True, root_certificates=cert.read_bytes(), retry=NO_RETRY, timeout=30, **kwargs)


def test_tls_with_api_key(secure_server: ServerThread, tls_files) -> None:
    cert, _ = tls_files
    for key in (KEY, OTHER_KEY):
        with _tls_client(secure_server, cert, api_key=key) as c:
            r = c.generate("hello", max_new_tokens=3, ignore_eos=True)
            assert len(r.token_ids) == 3
            assert len(list(c.generate_stream("hello", max_new_tokens=3, ignore_eos=True))) >= 1
            assert c.model_info().config.vocab_size == 512


@pytest.mark.parametrize("api_key", [None, "wrong", KEY + "x", KEY[:-1]])
def test_missing_or_wrong_key_is_unauthenticated(secure_server: ServerThread, tls_files, api_key, caplog) -> None:
    cert, _ = tls_files
    caplog.set_level(logging.DEBUG)
    with _tls_client(secure_server, cert, api_key=api_key) as c:
        for call in (lambda: c.generate("hello", max_new_tokens=2), lambda: list(c.generate_stream("hello"))):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            c.tokenize("x")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert c.health() == "SERVING"  # health stays open
    assert KEY not in caplog.text and OTHER_KEY not in caplog.text


def test_plaintext_client_cannot_talk_to_tls_server(secure_server: ServerThread) -> None:
    with (
        TandemClient(secure_server.target, api_key=KEY, retry=NO_RETRY, timeout=5) as c,
        pytest.raises(grpc.RpcError) as info,
    ):
        c.generate("hello", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_wrong_server_name_is_rejected(secure_server: ServerThread, tls_files) -> None:
    cert, _ = tls_files
    with (
        _tls_client(secure_server, cert, api_key=KEY, tls_server_name="not-this-host") as c,
        pytest.raises(grpc.RpcError) as info,
    ):
        c.generate("hello", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_key_check_needs_the_bearer_scheme() -> None:
    icpt = ApiKeyInterceptor([KEY.encode()])
    assert icpt.authorized([("authorization", f"Bearer {KEY}")])
    assert icpt.authorized([("authorization", f"bearer {KEY}")])
    assert not icpt.authorized([("authorization", KEY)])
    assert not icpt.authorized([("authorization", f"Basic {KEY}")])
    assert not icpt.authorized([("x-api-key", KEY)])
    assert not icpt.authorized(None)
    assert not icpt.authorized([("authorization", "Bearer ")])


def test_http_api_is_https_with_the_same_certificate_and_keys(bundle_dir, tls_files, tmp_path) -> None:
    import ssl

    import httpx2 as httpx

    cert, key = tls_files
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    srv = make_server(bundle_dir, tls_cert=str(cert), tls_key=str(key), api_key_file=str(keys), http_port=0)
    try:
        url = f"https://127.0.0.1:{srv.server.http_port}/v1/completions"
        verify = ssl.create_default_context(cafile=str(cert))
        body = {"prompt": "import os", "max_tokens": 2}
        ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, verify=verify, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert httpx.post(url, json=body, verify=verify, timeout=30).status_code == 401
        with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
            httpx.post(url.replace("https", "http"), json=body, timeout=5)
    finally:
        srv.close()
