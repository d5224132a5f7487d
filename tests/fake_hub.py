"""A local stand-in for the model hub's file API, enough for `huggingface_hub.hf_hub_download` (0.34).

What the client does, and so what this answers (read from huggingface_hub 0.34.3, `file_download.py`):

- `HEAD {endpoint}/{repo_id}/resolve/{revision}/{filename}`, redirects not followed (relative ones are).
  It needs `X-Repo-Commit`, an ETag (`X-Linked-Etag` before `ETag`) and a size (`X-Linked-Size` before
  `Content-Length`); without any of them the download fails as "not on the hub".
- A large (LFS) file answers that HEAD with a 302 to an absolute CDN address plus the `X-Linked-*` headers;
  the client then GETs the CDN address directly. A small (git) file answers 200 with `ETag`/`Content-Length`.
- `GET` of the file, with `Range: bytes=N-` when an `.incomplete` file of N bytes is already there.
- Errors are typed by `X-Error-Code` (GatedRepo, RepoNotFound, EntryNotFound, RevisionNotFound) and
  explained by `X-Error-Message`. A gated repo answers 401 without a token, 403 with one that has not
  accepted the licence, with the hub's own wording.

Every request is recorded (`FakeHub.requests`), so tests can assert what the client asked for.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    gated: bool = False
    tokens: frozenset[str] = frozenset()  # tokens whose accounts have accepted the licence of a gated repo
    lfs: bool = True  # answer like LFS files (302 to the CDN) rather than small git files
    commit: str = ""

    def __post_init__(self) -> None:
        self.commit = self.commit or hashlib.sha1(repr(sorted(self.files)).encode()).hexdigest()


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    # files (by name) whose next full GET sends half the body, then drops the connection
    truncate_once: set[str] = field(default_factory=set)
    requests: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._blobs = {
            hashlib.sha256(b).hexdigest(): (name, b) for r in self.repos.values() for name, b in r.files.items()
        }
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.requests.append(seen)

    def seen(self, filename: str) -> list[Seen]:
        """The requests that named this file, at the resolve address or at its blob on the CDN."""
        shas = {sha for sha, (name, _) in self._blobs.items() if name.rsplit("/", 1)[-1] == filename.rsplit("/", 1)[-1]}
        return [s for s in self.requests if s.path.endswith("/" + filename) or any(sha in s.path for sha in shas)]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    resolve = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like the hub; every answer carries Content-Length

        def log_message(self, *args) -> None:  # quiet: the test output is the client's
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.record(Seen(self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
            if path.startswith("/cdn/"):
                return self._blob(path.removeprefix("/cdn/"), body)
            m = resolve.match(path)
            if not m:
                return self._error(404, None, "Not Found", body)
            repo = hub.repos.get(m["repo"])
            if repo is None:
                return self._error(401, "RepoNotFound", "Repository not found", body)
            if repo.gated:
                auth = self.headers.get("Authorization", "")
                if not auth:
                    msg = (
                        f"Access to model {m['repo']} is restricted. You must have access to it and be "
                        "authenticated to access it. Please log in."
                    )
                    return self._error(401, "GatedRepo", msg, body)
                if auth.removeprefix("Bearer ") not in repo.tokens:
                    msg = (
                        f"Access to model {m['repo']} is restricted and you are not in the authorized list. "
                        f"Visit {hub.url}/{m['repo']} to ask for access."
                    )
                    return self._error(403, "GatedRepo", msg, body)
            if m["rev"] not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {m['rev']}", body)
            data = repo.files.get(m["file"])
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found", body)
            common = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes", "X-Request-Id": "fake-request"}
            if repo.lfs:
                sha = hashlib.sha256(data).hexdigest()
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
                headers = {
                    **common,
                    "Location": f"{hub.url}/cdn/{sha}?filename={m['file'].rsplit('/', 1)[-1]}",
                    "ETag": '"' + hashlib.sha1(pointer.encode()).hexdigest() + '"',
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                }
                return self._send(302, headers, b"Found. Redirecting", body)
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # a git blob id, as the hub sends
            return self._bytes(data, {**common, "ETag": f'"{etag}"'}, m["file"], body)

        def _blob(self, sha: str, body: bool) -> None:
            if sha not in hub._blobs:
                return self._send(404, {}, b"NoSuchKey", body)
            name, data = hub._blobs[sha]
            self._bytes(data, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"}, name, body)

        def _bytes(self, data: bytes, headers: dict[str, str], name: str, body: bool) -> None:
            headers = {**headers, "Content-Disposition": f'inline; filename="{name.rsplit("/", 1)[-1]}"'}
            rng = self.headers.get("Range")
            if rng:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                start = int(m[1]) if m else len(data)
                end = min(int(m[2]), len(data) - 1) if m and m[2] else len(data) - 1
                if start >= len(data):
                    return self._send(416, {"Content-Range": f"bytes */{len(data)}"}, b"", body)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._send(206, headers, data[start : end + 1], body)
            if body and name in hub.truncate_once:
                hub.truncate_once.discard(name)
                return self._send(200, headers, data, body, cut=len(data) // 2)
            return self._send(200, headers, data, body)

        def _error(self, status: int, code: str | None, message: str, body: bool) -> None:
            headers = {"X-Request-Id": "fake-request", "Content-Type": "application/json; charset=utf-8"}
            if code:
                headers["X-Error-Code"] = code
            headers["X-Error-Message"] = message
            self._send(status, headers, json.dumps({"error": message}).encode(), body)

        def _send(self, status: int, headers: dict[str, str], data: bytes, body: bool, cut: int | None = None) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not body:
                return
            if cut is None:
                self.wfile.write(data)
                return
            self.wfile.write(data[:cut])  # then the connection drops, as a reset mid-download does
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    return Handler
