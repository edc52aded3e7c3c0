"""Real servers for tests, each on 127.0.0.1 and a free port, always stopped afterwards."""

from __future__ import annotations

import base64
import contextlib
import http.server
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from commands.services import wait_http
from training.processes import free_port, kill_tree

BIN = Path(sys.executable).parent


@contextlib.contextmanager
def started(command: list[str], url: str, log: Path, env: dict | None = None,
            timeout: float = 120) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as out:
        # Servers exec helpers (uvicorn, gunicorn) by name: this environment's bin comes first.
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PATH": path, **(env or {})},
                                start_new_session=True)
    try:
        wait_http(url, timeout, proc)
        yield proc
    finally:
        kill_tree(proc)


@contextlib.contextmanager
def mlflow_server(folder: Path, port: int | None = None, host: str = "127.0.0.1"
                  ) -> Iterator[str]:
    """An MLflow server on `folder`'s store; the same folder and port again is a restart."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    command = [str(BIN / "mlflow"), "server", "--host", host, "--port", str(port),
               "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
               "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"]
    url = f"http://{host}:{port}"
    with started(command, f"{url}/health", folder / "mlflow.log"):
        yield url


class _GitHandler(http.server.BaseHTTPRequestHandler):
    """git's smart HTTP protocol (`git http-backend`, as a CGI) behind Basic auth."""

    protocol_version = "HTTP/1.1"
    root: Path
    password: str

    def do_GET(self):
        self._serve()

    def do_POST(self):
        self._serve()

    def _serve(self):
        user, _, given = base64.b64decode(
            self.headers.get("Authorization", "Basic ").removeprefix("Basic ")).decode(
            errors="replace").partition(":")
        if given != self.password:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(self.root),
               "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path, "QUERY_STRING": query,
               "REQUEST_METHOD": self.command, "REMOTE_USER": user,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body))}
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True,
                             check=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        headers = [line.split(": ", 1) for line in head.decode().split("\r\n") if line]
        status = next((int(v.split()[0]) for k, v in headers if k == "Status"), 200)
        self.send_response(status)
        for key, value in headers:
            if key != "Status":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def git_https_server(root: Path, password: str) -> Iterator[tuple[str, Path]]:
    """The bare repositories under `root` over HTTPS with Basic auth (any user, this password);
    yields the base URL and the self-signed certificate a client must trust."""
    cert, key = root / "cert.pem", root / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    handler = type("Handler", (_GitHandler,), {"root": root, "password": password})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", cert
    finally:
        server.shutdown()
        server.server_close()
