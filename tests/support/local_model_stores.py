"""Model stores as other tools leave them, built in tmp dirs for the tests: Ollama's manifests and blobs,
LM Studio's publisher/repo folders, and a local server speaking the Hugging Face hub's file API (what
huggingface_hub asks: the model info with its file list, HEAD and ranged GET of /resolve/)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


def add_ollama_model(root: Path, name: str, gguf: bytes, *, namespace: str = "library",
                     registry: str = "registry.ollama.ai", tag: str = "latest",
                     extra_layers: dict[str, bytes] | None = None) -> Path:
    """Write an Ollama manifest for ``gguf`` (and ``extra_layers`` {media type: bytes}); return its blob path."""
    layers = []
    for media_type, data in {"application/vnd.ollama.image.model": gguf, **(extra_layers or {})}.items():
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)})
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": "sha256:" + "0" * 64, "size": 2}, "layers": layers}
    path = root / "manifests" / registry / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return root / "blobs" / f"sha256-{hashlib.sha256(gguf).hexdigest()}"


class FakeHub:
    """Repositories {repo_id: {path: bytes}} served on 127.0.0.1 like the hub serves them; ``requests`` records
    (method, path, Range header, Authorization header) of every request."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[tuple[str, str, str, str]] = []
        self.drop_after: dict[str, int] = {}  # file -> bytes its next whole GET sends before the connection drops
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub.answer(self, body=True)

            def do_HEAD(self):
                hub.answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def commit(self, repo: str) -> str:
        digest = hashlib.sha1()
        for path, data in sorted(self.repos[repo].items()):
            digest.update(path.encode() + hashlib.sha256(data).digest())
        return digest.hexdigest()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        """Answer one GET (`body`) or HEAD the request handler received, recording it in `requests`."""
        path = urlsplit(handler.path).path
        self.requests.append((handler.command, path, handler.headers.get("Range", ""),
                              handler.headers.get("Authorization", "")))
        if path.startswith("/api/models/"):
            repo = path[len("/api/models/"):].split("/revision/")[0]
            if repo not in self.repos:
                return _send(handler, 404, b'{"error": "Repository not found"}', body,
                             {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
            info = {"id": repo, "modelId": repo, "sha": self.commit(repo), "private": False,
                    "siblings": [{"rfilename": f} for f in sorted(self.repos[repo])]}
            return _send(handler, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        repo, _, rest = path.lstrip("/").partition("/resolve/")
        file_name = rest.partition("/")[2]
        data = self.repos.get(repo, {}).get(file_name)
        if data is None:
            return _send(handler, 404, b'{"error": "Entry not found"}', body, {"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": self.commit(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = int(handler.headers["Range"].split("=")[1].split("-")[0]) if handler.headers.get("Range") else 0
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = self.drop_after.pop(file_name, None) if body and not start else None
        if cut is not None:  # the whole length announced, part of it sent, then the connection is gone
            handler.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data[:cut])
            handler.close_connection = True
            return
        _send(handler, 206 if start else 200, data[start:], body, headers)

    @contextlib.contextmanager
    def running(self):
        thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(timeout=5)


def _send(handler, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
    handler.send_response(status)
    for key, value in headers.items():
        handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if body:
        handler.wfile.write(data)
