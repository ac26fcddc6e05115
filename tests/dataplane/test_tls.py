"""An ``https://`` upstream: the data plane's rustls client, its roots, and ``SSL_CERT_FILE``.

The upstream is a TLS server in a thread (the standard library's
``http.server`` on an ``ssl`` socket) with a certificate that a CA made for
the test by ``openssl`` signed: with that CA in ``SSL_CERT_FILE`` the call
goes through; without it the handshake fails and the call is a 502 naming
the certificate.
"""

from __future__ import annotations

import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trio

from lowwater._native import DataPlane, DataPlaneConfigError, TurnRecord
from lowwater.interception.dataplane import serve_records

ANSWER = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}}],
}


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA, and a server certificate it signed for ``localhost`` and
    127.0.0.1 with that certificate's key: ``(ca, cert, key)`` PEM files."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl (Debian's openssl package) makes the test's certificates"
    ca, ca_key, csr = directory / "ca.pem", directory / "ca.key", directory / "server.csr"
    cert, key, ext = directory / "cert.pem", directory / "key.pem", directory / "server.ext"
    ext.write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for argv in [
        ["req", "-x509", *ec, "-days", "1", "-subj", "/CN=lowwater test CA", "-keyout", ca_key, "-out", ca],
        ["req", *ec, "-subj", "/CN=localhost", "-keyout", key, "-out", csr],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1"]
        + ["-extfile", ext, "-out", cert],
    ]:
        subprocess.run([openssl, *map(str, argv)], check=True, capture_output=True, cwd=directory)
    return ca, cert, key


class Answering(http.server.BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        Answering.seen.append({"path": self.path, "auth": self.headers.get("authorization"), "body": json.loads(body)})
        out = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def tls_upstream(cert: Path, key: Path) -> Iterator[int]:
    """A TLS upstream on 127.0.0.1 until the block ends; its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def call_through(upstream: str) -> tuple[httpx.Response, list[TurnRecord]]:
    """One chat call through a plane in front of ``upstream``; the answer and the records."""
    records: list[TurnRecord] = []
    plane = DataPlane(upstream, api_key="upstream-key", retries=0)
    try:

        async def main() -> httpx.Response:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_records, plane, records.append)
                plane.register("r0", "s0")
                async with httpx.AsyncClient(timeout=30) as client:
                    answer = await client.post(
                        f"http://{plane.address}/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "2+2?"}]},
                        headers={"authorization": "Bearer s0"},
                    )
                while plane.stats()["active_calls"] or plane.stats()["queued"]:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
            return answer

        return trio.run(main), records
    finally:
        plane.close()


def test_an_https_upstream_trusted_through_ssl_cert_file(tmp_path, monkeypatch) -> None:
    ca, cert, key = make_certificates(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    Answering.seen.clear()
    with tls_upstream(cert, key) as port:
        answer, records = call_through(f"https://localhost:{port}/v1")
    assert answer.status_code == 200, answer.text
    assert answer.json() == ANSWER
    (seen,) = Answering.seen
    assert seen["path"] == "/v1/chat/completions" and seen["auth"] == "Bearer upstream-key"
    (record,) = records
    assert record.status == 200 and record.error is None


def test_an_untrusted_certificate_is_a_502_naming_it(tmp_path, monkeypatch) -> None:
    _, cert, key = make_certificates(tmp_path)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    Answering.seen.clear()
    with tls_upstream(cert, key) as port:
        answer, records = call_through(f"https://localhost:{port}/v1")
    assert answer.status_code == 502, answer.text
    assert "certificate" in answer.json()["error"]["message"].lower()
    assert Answering.seen == []  # nothing was sent over an unverified connection
    (record,) = records
    assert record.status == 502 and record.error


def test_an_unreadable_ssl_cert_file_is_refused_at_start(tmp_path, monkeypatch) -> None:
    (tmp_path / "empty.pem").write_text("not a certificate\n")
    for path, why in [(tmp_path / "missing.pem", "missing.pem"), (tmp_path / "empty.pem", "no certificate")]:
        monkeypatch.setenv("SSL_CERT_FILE", str(path))
        with pytest.raises(DataPlaneConfigError, match=why):
            DataPlane("http://127.0.0.1:9/v1")
