"""A local Hugging Face Hub: serves model folders at pinned commits over the Hub's HTTP API.

Enough of the API for ``huggingface_hub.snapshot_download`` (the path ``vllm-fleet fetch`` takes for
``source.hf``): revision info, the recursive tree listing, and ``resolve`` downloads with ETags, the commit
header and byte ranges (resume). Nothing can be downloaded on the test machines, so the real download code
runs against this instead (``HF_ENDPOINT=http://127.0.0.1:PORT``). Faults for tests: ``cut`` breaks the
first download of a file after some bytes (the client must resume with a Range request).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


@dataclass
class Repo:
    commit: str
    refs: dict[str, str]  # tag/branch → commit
    files: dict[str, bytes]


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    # (method, path, Range header or "") of every request, in order
    log: list[tuple[str, str, str]] = field(default_factory=list)
    # path inside a repo → bytes after which its first GET is cut off
    cut: dict[str, int] = field(default_factory=dict)
    # path inside a repo → seconds between 64 KiB chunks of its downloads (to interrupt a fetch mid-file)
    slow: dict[str, float] = field(default_factory=dict)
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, folder: Path, tags: tuple[str, ...] = ()) -> str:
        """Publish ``folder`` as ``repo_id``; returns its commit hash (also reachable as each tag)."""
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
        }
        h = hashlib.sha1(repo_id.encode())
        for rel, data in files.items():
            h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        commit = h.hexdigest()
        self.repos[repo_id] = Repo(commit, {t: commit for t in tags}, files)
        return commit

    def start(self) -> LocalHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def downloads(self, rel: str) -> list[str]:
        """Range headers of the GETs of one file ("" for a whole-file GET)."""
        return [r for m, p, r in self.log if m == "GET" and "/resolve/" in p and p.endswith("/" + rel)]


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(rel: str) -> bool:
    return rel.endswith(LFS_SUFFIXES)


def _etag(rel: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if _is_lfs(rel) else _blob_oid(data)


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # ------------------------------------------------------------------ plumbing
    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
            return None
        commit = rev if rev == repo.commit else repo.refs.get(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, commit

    # ------------------------------------------------------------------ routes
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.log.append((self.command, path, self.headers.get("Range", "")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
            self._revision(m.group(1), m.group(2))
        elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            self._tree(m.group(1), m.group(2), m.group(3) or "")
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            self._resolve(m.group(1), m.group(2), m.group(3))
        else:
            self._error(404, "EntryNotFound", f"no route for {path}")

    def _revision(self, repo_id: str, rev: str) -> None:
        found = self._repo(repo_id, rev)
        if found:
            repo, commit = found
            siblings = [{"rfilename": rel} for rel in repo.files]
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings,
                             "private": False, "tags": [], "lastModified": "2026-01-01T00:00:00.000Z"})  # fmt: skip

    def _tree(self, repo_id: str, rev: str, under: str) -> None:
        found = self._repo(repo_id, rev)
        if not found:
            return
        repo, _ = found
        entries: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for rel, data in repo.files.items():
            if under and not rel.startswith(under.rstrip("/") + "/"):
                continue
            parts = rel.split("/")
            for i in range(1, len(parts)):
                dirs.add("/".join(parts[:i]))
            entry: dict[str, Any] = {"type": "file", "oid": _blob_oid(data), "size": len(data), "path": rel}
            if _is_lfs(rel):
                sha = hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [
            {"type": "directory", "oid": _blob_oid(d.encode()), "size": 0, "path": d} for d in sorted(dirs)
        ]
        self._json(200, entries)

    def _resolve(self, repo_id: str, rev: str, rel: str) -> None:
        found = self._repo(repo_id, rev)
        if not found:
            return
        repo, commit = found
        data = repo.files.get(rel)
        if data is None:
            self._error(404, "EntryNotFound", f"{rel} does not exist on {rev}")
            return
        etag = f'"{_etag(rel, data)}"'
        headers = {"X-Repo-Commit": commit, "ETag": etag, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}  # fmt: skip
        if _is_lfs(rel):
            headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))}
        start = 0
        if rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = int(rng.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        cut = self.hub.cut.pop(rel, None) if self.command == "GET" else None
        pause = self.hub.slow.get(rel) if self.command == "GET" else None
        if cut is None and pause is None:
            self._send(status, data[start:], headers)
            return
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        body = data[start:] if cut is None else data[start : start + cut]
        try:
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i : i + (1 << 16)])
                self.wfile.flush()
                if pause:
                    time.sleep(pause)
        except OSError:  # the client went away
            self.close_connection = True
            return
        if cut is not None:  # announced the whole body, sent part of it: drop the connection
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
