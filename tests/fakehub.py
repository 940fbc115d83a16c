"""A fake Hugging Face Hub on loopback: a real HTTP server (threaded `http.server`) that answers exactly the calls
huggingface_hub 2.4.0 makes for what higgs-onnx does with the Hub, over plain HTTP and LFS (no Xet: a client
uploading to it needs `HF_HUB_DISABLE_XET=1`; downloads are plain HTTP since no answer carries Xet headers).

    hub = FakeHub(tmp / "hub", token="hf_write")   # started; hub.url is what HF_ENDPOINT is set to
    hub.add_folder("org/repo", export_dir, "cpu_int4")   # a commit on main with the folder's files
    hub.requests                                   # [(method, path)] of every request served

Served: repo info (`/api/models/R[/revision/V]`), the file tree (`/api/models/R/tree/V[/P]`), files
(`HEAD|GET /R/resolve/V/P`, with X-Repo-Commit, ETag, X-Linked-Etag/-Size for LFS files, Range), repo creation,
branches, preupload, the LFS batch API with a basic PUT, the NDJSON commit, YAML validation. Errors carry the
`X-Error-Code` the client maps to its exceptions (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo); a
private repo answers 401 RepoNotFound without a valid token, a wrong token 401 "Invalid credentials".
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".onnx", ".data", ".npz", ".safetensors", ".bin")
LFS_BYTES = 64 << 10  # a file at least this large goes through LFS


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, size: int) -> bool:
    return size >= LFS_BYTES or path.endswith(LFS_SUFFIXES)


@dataclass
class Repo:
    private: bool = False
    gated: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    commits: dict[str, dict[str, str]] = field(default_factory=dict)  # sha -> {path: sha256 of its bytes}


class HubError(Exception):
    def __init__(self, status: int, code: str | None = None, message: str | None = None, commit: str | None = None,
                 extra: dict | None = None):
        super().__init__(message or code or str(status))
        self.status, self.code, self.message, self.commit = status, code, message, commit
        self.extra = extra or {}  # more fields of the JSON body (the Hub's 409 on a repo that exists has its url)


class FakeHub:
    """The repos (in memory) and their blobs (files under `root`), served on 127.0.0.1 from a thread."""

    def __init__(self, root: Path, token: str | None = None):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- content ---------------------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.root / "blobs" / sha
        if not path.exists():
            path.write_bytes(data)
        return sha

    def blob(self, sha: str) -> bytes:
        return (self.root / "blobs" / sha).read_bytes()

    def create(self, repo_id: str, private: bool = False, gated: bool = False) -> Repo:
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo(private=private, gated=gated))
            if not repo.branches:
                repo.branches["main"] = self._commit(repo, {}, None, "initial commit")
            return repo

    def _commit(self, repo: Repo, files: dict[str, str], parent: str | None, summary: str) -> str:
        sha = hashlib.sha1(json.dumps([parent, summary, sorted(files.items()), len(repo.commits)]).encode()).hexdigest()
        repo.commits[sha] = dict(files)
        return sha

    def commit(self, repo_id: str, changes: dict[str, bytes | None], branch: str = "main",
               summary: str = "commit") -> str:
        """A commit on `branch` adding (bytes) or deleting (None) files; returns its sha."""
        repo = self.repos[repo_id] if repo_id in self.repos else self.create(repo_id)
        with self.lock:
            parent = repo.branches[branch]
            files = dict(repo.commits[parent])
            for path, data in changes.items():
                if data is None:
                    files = {p: s for p, s in files.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
                else:
                    files[path] = self.put_blob(data)
            repo.branches[branch] = sha = self._commit(repo, files, parent, summary)
            return sha

    def add_folder(self, repo_id: str, folder: Path, path_in_repo: str = "", branch: str = "main",
                   **repo_flags) -> str:
        """Every file under `folder` committed at `path_in_repo` (a new repo is made with `repo_flags`)."""
        if repo_id not in self.repos:
            self.create(repo_id, **repo_flags)
        prefix = f"{path_in_repo.strip('/')}/" if path_in_repo.strip("/") else ""
        changes = {prefix + p.relative_to(folder).as_posix(): p.read_bytes()
                   for p in sorted(Path(folder).rglob("*")) if p.is_file()}
        return self.commit(repo_id, changes, branch, f"add {path_in_repo or 'files'}")

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        sha = repo.branches.get(revision, revision)
        return {p: self.blob(s) for p, s in repo.commits[sha].items()}

    def gets(self, suffixes: tuple[str, ...]) -> list[str]:
        """The paths of the file GETs served whose name ends with one of `suffixes`."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p and p.endswith(suffixes)]

    # -- lookups that answer with the Hub's errors -----------------------------------------------------------
    def auth(self, headers, repo_id: str | None, write: bool = False) -> None:
        given = headers.get("Authorization", "")
        token = given[7:] if given.startswith("Bearer ") else None
        if token is not None and token != self.token:
            raise HubError(401, message="Invalid credentials in Authorization header")
        repo = self.repos.get(repo_id) if repo_id else None
        if token is None and (write or (repo is not None and repo.private)):
            raise HubError(401, "RepoNotFound", "Repository not found")
        if token is None and repo is not None and repo.gated:
            raise HubError(403, "GatedRepo", "Access to this repo is restricted: you must be authenticated")

    def repo(self, repo_id: str, headers, write: bool = False) -> Repo:
        self.auth(headers, repo_id, write)
        if repo_id not in self.repos:
            raise HubError(404, "RepoNotFound", "Repository not found")
        return self.repos[repo_id]

    @staticmethod
    def resolve(repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")


def _entry(hub: FakeHub, path: str, sha256: str) -> dict:
    data = hub.blob(sha256)
    out = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
    if is_lfs(path, len(data)):
        out["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": 134}
    return out


def _tree(hub: FakeHub, files: dict[str, str], under: str, recursive: bool) -> list[dict]:
    prefix = f"{under}/" if under else ""
    if under and not any(p.startswith(prefix) for p in files):
        raise HubError(404, "EntryNotFound", f"{under} does not exist")
    out, folders = [], set()
    for path in sorted(files):
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix):]
        if "/" in rest and not recursive:
            folders.add(prefix + rest.split("/")[0])
            continue
        if recursive:
            parts = rest.split("/")[:-1]
            folders.update(prefix + "/".join(parts[:i + 1]) for i in range(len(parts)))
        out.append(_entry(hub, path, files[path]))
    return [{"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in sorted(folders)] \
        + out


API_REPO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
API_TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.+))?$")
API_POST = re.compile(r"^/api/models/([^/]+/[^/]+)/(preupload|commit|branch)/([^/]+)$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
LFS_BATCH = re.compile(r"^/([^/]+/[^/]+)\.git/info/lfs/objects/batch$")
LFS_PUT = re.compile(r"^/_lfs/([0-9a-f]{64})$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the tests read hub.requests
            pass

        def _route(self, method: str) -> None:
            url = urlsplit(self.path)
            with hub.lock:
                hub.requests.append((method, unquote(url.path)))
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                self._answer(method, url.path, parse_qs(url.query), body)
            except HubError as e:
                headers = {"X-Error-Code": e.code, "X-Error-Message": e.message, "X-Repo-Commit": e.commit}
                self._send(e.status, json.dumps({"error": e.message or e.code, **e.extra}).encode(),
                           {k: v for k, v in headers.items() if v}, "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server's names
            self._route("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._route("HEAD")

        def do_POST(self) -> None:  # noqa: N802
            self._route("POST")

        def do_PUT(self) -> None:  # noqa: N802
            self._route("PUT")

        def _send(self, status: int, body: bytes, headers: dict | None = None, kind: str = "application/json",
                  length: int | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, data, status: int = 200) -> None:
            self._send(status, json.dumps(data).encode())

        def _answer(self, method: str, path: str, query: dict, body: bytes) -> None:
            if method in ("GET", "HEAD") and (m := RESOLVE.match(path)):
                return self._file(unquote(m[1]), unquote(m[2]), unquote(m[3]))
            if method == "GET" and (m := API_TREE.match(path)):
                repo = hub.repo(unquote(m[1]), self.headers)
                files = repo.commits[hub.resolve(repo, unquote(m[2]))]
                recursive = query.get("recursive", ["False"])[0].lower() in ("true", "1")
                return self._json(_tree(hub, files, unquote(m[3] or "").strip("/"), recursive))
            if method == "GET" and (m := API_REPO.match(path)):
                return self._info(unquote(m[1]), unquote(m[2] or "main"))
            if method == "POST" and path == "/api/repos/create":
                return self._create(json.loads(body))
            if method == "POST" and path == "/api/validate-yaml":
                hub.auth(self.headers, None)
                return self._json({"errors": [], "warnings": []})
            if method == "POST" and (m := API_POST.match(path)):
                repo_id, revision = unquote(m[1]), unquote(m[3])
                repo = hub.repo(repo_id, self.headers, write=True)
                if m[2] == "branch":
                    return self._branch(repo, revision, json.loads(body or b"{}"))
                if m[2] == "preupload":
                    return self._preupload(repo, revision, json.loads(body))
                return self._commit(repo_id, repo, revision, body)
            if method == "POST" and (m := LFS_BATCH.match(path)):
                hub.repo(unquote(m[1]), self.headers, write=True)
                return self._lfs_batch(json.loads(body))
            if method == "PUT" and (m := LFS_PUT.match(path)):
                if hashlib.sha256(body).hexdigest() != m[1]:
                    raise HubError(400, message="the uploaded bytes do not match their sha256")
                hub.put_blob(body)
                return self._json({})
            raise HubError(404, message=f"no route for {method} {path}")

        def _info(self, repo_id: str, revision: str) -> None:
            repo = hub.repo(repo_id, self.headers)
            sha = hub.resolve(repo, revision)
            self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                        "gated": "auto" if repo.gated else False,
                        "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])]})

        def _file(self, repo_id: str, revision: str, path: str) -> None:
            repo = hub.repo(repo_id, self.headers)
            sha = hub.resolve(repo, revision)
            if path not in repo.commits[sha]:
                raise HubError(404, "EntryNotFound", f"{path} does not exist at {revision}", commit=sha)
            data = hub.blob(repo.commits[sha][path])
            etag = f'"{repo.commits[sha][path] if is_lfs(path, len(data)) else git_blob_sha1(data)}"'
            headers = {"X-Repo-Commit": sha, "ETag": etag, "Accept-Ranges": "bytes"}
            if is_lfs(path, len(data)):
                headers.update({"X-Linked-Etag": etag, "X-Linked-Size": str(len(data))})
            rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if rng and self.command == "GET":
                start = int(rng[1])
                end = int(rng[2]) if rng[2] else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._send(206, data[start:end + 1], headers, "application/octet-stream")
            self._send(200, data, headers, "application/octet-stream")

        def _create(self, payload: dict) -> None:
            hub.auth(self.headers, None, write=True)
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") \
                else payload["name"]
            if repo_id in hub.repos:
                raise HubError(409, message="You already created this model repo",
                               extra={"url": f"{hub.url}/{repo_id}"})
            hub.create(repo_id, private=payload.get("private") is True or payload.get("visibility") == "private")
            self._json({"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _branch(self, repo: Repo, branch: str, payload: dict) -> None:
            if branch in repo.branches:
                raise HubError(409, message="Reference already exists")
            repo.branches[branch] = hub.resolve(repo, payload.get("startingPoint") or "main")
            self._json({})

        def _preupload(self, repo: Repo, revision: str, payload: dict) -> None:
            files = repo.commits[hub.resolve(repo, revision)]
            out = []
            for f in payload["files"]:
                mode = "lfs" if is_lfs(f["path"], f["size"]) else "regular"
                old = files.get(f["path"])
                oid = None if old is None else (old if mode == "lfs" else git_blob_sha1(hub.blob(old)))
                out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
            self._json({"files": out})

        def _lfs_batch(self, payload: dict) -> None:
            objects = []
            for o in payload["objects"]:
                item = {"oid": o["oid"], "size": o["size"]}
                if not (hub.root / "blobs" / o["oid"]).exists():
                    item["actions"] = {"upload": {"href": f"{hub.url}/_lfs/{o['oid']}"}}
                objects.append(item)
            self._json({"transfer": "basic", "objects": objects})

        def _commit(self, repo_id: str, repo: Repo, revision: str, body: bytes) -> None:
            hub.resolve(repo, revision)
            if revision not in repo.branches:
                raise HubError(400, message=f"{revision} is not a branch")
            changes: dict[str, bytes | None] = {}
            summary = "commit"
            for line in body.decode().splitlines():
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "header":
                    summary = value["summary"]
                elif item["key"] == "file":
                    changes[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "lfsFile":
                    blob = hub.root / "blobs" / value["oid"]
                    if not blob.exists():
                        raise HubError(400, message=f"LFS object {value['oid']} was never uploaded")
                    changes[value["path"]] = blob.read_bytes()
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    changes[value["path"]] = None
            sha = hub.commit(repo_id, changes, revision, summary)
            self._json({"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                        "pullRequestUrl": None})

    return Handler


class BadProxy:
    """A misbehaving Hub in front of a FakeHub, on loopback: `mode` (settable while it runs) is "ok" (forwarded as
    is), "stall" (a `.data` file's GET sends half its bytes, then nothing), "lie" (every `.data` GET answers its
    bytes flipped), "lie-once" (the first `.data` GET only), "500" (every request answers 500), "stall-write" (a
    POST or PUT never answers). `url` is what HF_ENDPOINT is set to; `seen` counts the `.data` GETs."""

    def __init__(self, hub: FakeHub, mode: str = "ok"):
        self.hub, self.mode, self.seen = hub, mode, 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _proxy_handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _proxy_handler(proxy: BadProxy):
    import http.client

    up = urlsplit(proxy.hub.url)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _status(self, status: int) -> None:
            body = b'{"error": "internal error"}'
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def _go(self, method: str) -> None:
            mode = proxy.mode
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            data_get = method == "GET" and "/resolve/" in self.path and self.path.endswith(".data")
            if mode == "500":
                return self._status(500)
            if mode == "stall-write" and method in ("POST", "PUT"):
                proxy.stop.wait()
                return
            c = http.client.HTTPConnection(up.hostname, up.port, timeout=60)
            c.request(method, self.path, body=body,
                      headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            r = c.getresponse()
            data = r.read()
            c.close()
            if data_get:
                proxy.seen += 1
                if mode == "lie" or (mode == "lie-once" and proxy.seen == 1):
                    data = bytes(b ^ 1 for b in data)
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v.replace(proxy.hub.url, proxy.url))
            self.send_header("Content-Length", r.getheader("Content-Length") if method == "HEAD" else str(len(data)))
            self.end_headers()
            if method == "HEAD":
                return
            if data_get and mode == "stall":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                proxy.stop.wait()
                self.close_connection = True
                return
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._go("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._go("HEAD")

        def do_POST(self) -> None:  # noqa: N802
            self._go("POST")

        def do_PUT(self) -> None:  # noqa: N802
            self._go("PUT")

    return Handler
