"""A loopback stand-in for Kaggle's API, for the real `kaggle` client (KAGGLE_API_ENVIRONMENT=TEST).

It answers the two RPCs the download uses, as the real service does: a POST to
/api/v1/<Service>/<Method> with a JSON body and basic or bearer auth, answered with a redirect
to the archive, which is then fetched with GET. Knobs let tests script failures.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = 7777  # fixed by the client for KAGGLE_API_ENVIRONMENT=TEST


class KaggleStandIn:
    def __init__(self, username: str, key: str):
        self.credentials = (username, key)
        self.archives: dict[str, bytes] = {}  # "competitions/<slug>" or "datasets/<o>/<s>"
        self.forbidden: set[str] = set()  # rules not accepted
        self.cut_after: int | None = None  # close the connection after this many bytes
        self.requests: list[tuple[str, str]] = []
        self.downloads = 0
        self.seen_headers: list[str] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", PORT), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> KaggleStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _authorized(self) -> bool:
                header = self.headers.get("Authorization", "")
                standin.seen_headers.append(header)
                if header.startswith("Basic "):
                    user, _, key = base64.b64decode(header[6:]).decode().partition(":")
                    return (user, key) == standin.credentials
                return False

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                standin.requests.append(("POST", self.path))
                if not self._authorized():
                    return self._json(401, {"code": 401, "message": "Unauthenticated"})
                if self.path.endswith("competitions.CompetitionApiService/ListDataFiles"):
                    return self._files(f"competitions/{body.get('competitionName')}", "files")
                if self.path.endswith("datasets.DatasetApiService/ListDatasetFiles"):
                    return self._files(f"datasets/{body.get('ownerSlug')}/"
                                       f"{body.get('datasetSlug')}", "datasetFiles")
                if self.path.endswith("competitions.CompetitionApiService/DownloadDataFiles"):
                    ref = f"competitions/{body.get('competitionName')}"
                elif self.path.endswith("datasets.DatasetApiService/DownloadDataset"):
                    ref = f"datasets/{body.get('ownerSlug')}/{body.get('datasetSlug')}"
                    if body.get("datasetVersionNumber"):  # a pinned version: "<ref>@v<N>"
                        ref = f"{ref}@v{body['datasetVersionNumber']}"
                else:
                    return self._json(404, {"code": 404, "message": "no such method"})
                if ref in standin.forbidden:
                    return self._json(403, {"code": 403, "message": "You must accept the rules"})
                if ref not in standin.archives:
                    return self._json(404, {"code": 404, "message": "Not found"})
                self.send_response(302)
                self.send_header("Location", f"/files/{ref}/{ref.rsplit('/', 1)[1]}.zip")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _files(self, ref: str, field: str) -> None:
                """The file list of the version served now: a new archive is a new version,
                with its own size and date, as on Kaggle."""
                if ref not in standin.archives:
                    return self._json(404, {"code": 404, "message": "Not found"})
                data = standin.archives[ref]
                stamp = int(hashlib.sha256(data).hexdigest()[:6], 16)
                date = datetime.datetime(2024, 1, 1) + datetime.timedelta(seconds=stamp)
                return self._json(200, {field: [{
                    "ref": ref, "name": f"{ref.rsplit('/', 1)[1]}.zip", "totalBytes": len(data),
                    "creationDate": date.strftime("%Y-%m-%dT%H:%M:%SZ")}]})

            def do_GET(self):
                standin.requests.append(("GET", self.path))
                ref = self.path.removeprefix("/files/").rsplit("/", 1)[0]
                data = standin.archives.get(ref)
                if data is None:
                    return self._json(404, {"code": 404, "message": "Not found"})
                standin.downloads += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/zip")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
                self.end_headers()
                if standin.cut_after is not None:
                    self.wfile.write(data[: standin.cut_after])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

        return Handler
