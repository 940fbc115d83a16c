"""Exports on the Hugging Face Hub: a reference `hf://ORG/REPO/FOLDER@REVISION` fetched through huggingface_hub into
its cache (resumable, a progress bar, `HF_TOKEN`, `HF_HOME`/`HF_HUB_CACHE`, `HF_HUB_OFFLINE=1` served from the cache)
and opened like a local export folder; and publishing one (`push`, optimize.py --push-to-hub). docs/hub.md.

    ref = parse("hf://org/higgs-onnx/cpu_int4@v1")   # HubRef(repo_id, folder, revision)
    export = resolve_info(ref)                        # HubExport(path, repo_id, folder, revision, commit)
    resolve("hf://org/higgs-onnx/cpu_int4")           # the local folder (in the Hub cache: never written to)

Only the one folder is fetched, and only once the repo's file list at that revision shows it is an export of this
model (`manifest.json`, `tokenizer.json` and the six parts); every failure is one line (`HubError`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .hub_fetch import HubError  # noqa: F401 - the package's one Hub error, raised here and in hub_fetch

log = logging.getLogger(__name__)

SCHEME = "hf://"
SYNTAX = "hf://ORG/REPO/FOLDER@REVISION (FOLDER and @REVISION optional)"
PARTS = ("text_embed", "audio_encoder", "audio_embed", "llm_decoder", "audio_heads", "audio_tokenizer")
EXPORT_FILES = ("manifest.json", "tokenizer.json", *(f"{p}.onnx" for p in PARTS))
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")
_REVISION = re.compile(r"[A-Za-z0-9._-]+|refs/(?:pr|convert)/[A-Za-z0-9._-]+")
_RESOLVED: dict[str, HubExport] = {}  # local folder -> where it came from, for the runtime's `source`


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    folder: str = ""  # "" = the repo's root
    revision: str | None = None  # None = the default branch (main)

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}{'/' + self.folder if self.folder else ''}" + \
            (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubExport:
    """A fetched export: its local folder (read-only, in the Hub cache) and the commit it was fetched at."""
    path: Path
    repo_id: str
    folder: str
    revision: str
    commit: str

    @property
    def ref(self) -> str:
        return str(HubRef(self.repo_id, self.folder, self.revision))

    def __str__(self) -> str:
        return f"{self.ref} at commit {self.commit[:12]} -> {self.path}"


def is_hub_ref(value) -> bool:
    """True for a string that means the Hub (`hf:` ...), including malformed ones (`parse` says what is wrong)."""
    return isinstance(value, str) and value.startswith("hf:")


def parse(ref: str) -> HubRef:
    """`hf://ORG/REPO[/FOLDER...][@REVISION]` -> HubRef; anything else is refused with the form to write."""
    if not isinstance(ref, str) or not ref.startswith(SCHEME):
        raise HubError(f"{ref!r} is not a Hub reference: write {SYNTAX}")
    body, at, revision = ref[len(SCHEME):].partition("@")
    if at and (".." in revision or revision.endswith((".", ".lock", "/")) or
               any(seg.startswith(".") for seg in revision.split("/"))):  # git's ref rules; a path out of the URL
        raise HubError(f"{ref}: {revision!r} is not a revision (a branch, tag or commit; refs/pr/N): {SYNTAX}")
    if at and ("@" in revision or not _REVISION.fullmatch(revision)):
        if "/" in revision and not revision.startswith("refs/"):
            head = body.strip("/")
            raise HubError(f"{ref}: the revision goes at the end: {SCHEME}{head}/{revision.split('/', 1)[1]}@"
                           f"{revision.split('/', 1)[0]} ({SYNTAX})")
        raise HubError(f"{ref}: {revision!r} is not a revision (a branch, tag or commit; refs/pr/N): {SYNTAX}")
    parts = body.rstrip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise HubError(f"{ref}: expected {SYNTAX}")
    for i, name in enumerate(parts):
        if not _NAME.fullmatch(name) or ".." in name or (i < 2 and "--" in name):
            raise HubError(f"{ref}: {name!r} is not a valid repo or folder name ({SYNTAX})")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(f"{parts[0]}/{parts[1]}")
    except HFValidationError:
        shown = ref if len(ref) <= 120 else f"{ref[:60]}… ({len(ref)} characters)"
        raise HubError(f"{shown}: not a valid repo id (ORG and REPO: letters, digits, '-', '_', '.', at most 96 "
                       f"characters each; no '--' or '..', no '.git' at the end): {SYNTAX}") from None
    return HubRef(f"{parts[0]}/{parts[1]}", "/".join(parts[2:]), revision if at else None)


def model_path_arg(value: str) -> str | Path:
    """argparse `type=` for --model-path: a Hub reference stays a string (a Path would fold `hf://` into `hf:/`),
    anything else is a Path."""
    if not value.strip():
        import argparse

        raise argparse.ArgumentTypeError("an empty path: give an export folder or a Hub reference hf://ORG/REPO/FOLDER")
    return value if is_hub_ref(value) else Path(value)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve(ref: str | HubRef, *, token: str | None = None, progress: bool = True) -> Path:
    """The local folder of the export `ref` names, fetched if needed (`resolve_info`)."""
    return resolve_info(ref, token=token, progress=progress).path


def resolve_info(ref: str | HubRef, *, token: str | None = None, progress: bool = True) -> HubExport:
    """Fetch the export `ref` names into the Hub cache (only its folder, once the repo's listing at that revision
    shows an export there) and return where it is and the commit it came from. `token`: default `$HF_TOKEN` or
    the saved login. Offline (`HF_HUB_OFFLINE=1`): served from the cache, or refused by name."""
    r = parse(ref) if isinstance(ref, str) else ref
    from huggingface_hub import HfApi

    from . import hub_fetch as hf

    hf.quiet_hub_logging()
    api = HfApi(token=token)
    with _errors(r):
        rev, cause = hf.resolve(api, r, token, offline())
    cached_only = cause is not None
    with _errors(r, cause):
        lfs = hf.listing(api, r, rev, cached_only)
        files = sorted(lfs)
        tqdm_class = None if progress else _Quiet
        wanted = None
        prefix = f"{r.folder}/" if r.folder else ""
        if r.folder not in export_folders(files) and prefix + "manifest.json" in files:  # another layout?
            root = hf.fetch(r, rev, [prefix + "manifest.json"], lfs, token=token, cached_only=cached_only,
                            tqdm_class=tqdm_class)
            wanted = hf.community_files(r, files, hf.read_manifest(root / prefix / "manifest.json"))
        wanted = wanted or check_folder(r, files)
        root = hf.fetch(r, rev, wanted, lfs, token=token, cached_only=cached_only, tqdm_class=tqdm_class)
    path = Path(root, *r.folder.split("/")) if r.folder else Path(root)
    missing = [f[len(prefix):] for f in wanted if not (root / f).is_file()]
    if missing:
        raise HubError(f"{r}: the download left {', '.join(missing)} missing in {path}; run it again")
    export = HubExport(path, r.repo_id, r.folder, r.revision or "main", rev.resolved)
    if cause:
        from huggingface_hub import constants

        print(f"warning: cannot reach {constants.ENDPOINT} ({cause}): used {r} from the cache (as HF_HUB_OFFLINE=1 "
              f"would)", file=sys.stderr, flush=True)
    _RESOLVED[str(path.resolve())] = export
    log.info("%s", export)
    return export


def export_folders(files: list[str]) -> list[str]:
    """The folders of a repo's file list that hold an export ("" = the root), sorted."""
    by_folder: dict[str, set[str]] = {}
    for f in files:
        p = PurePosixPath(f)
        by_folder.setdefault("" if str(p.parent) == "." else str(p.parent), set()).add(p.name)
    return sorted(d for d, names in by_folder.items() if set(EXPORT_FILES) <= names)


def check_folder(r: HubRef, files: list[str]) -> list[str]:
    """The files to fetch for `r` (those directly in its folder), or a HubError naming what is wrong and the
    folders that do hold an export."""
    exports = export_folders(files)
    where = f"; exports there: {', '.join(e or '(the root)' for e in exports)}" if exports else \
        "; it holds no export of this model"
    prefix = f"{r.folder}/" if r.folder else ""
    mine = [f for f in files if f.startswith(prefix) and "/" not in f[len(prefix):]]
    if r.folder and not any(f.startswith(prefix) for f in files):
        raise HubError(f"{r}: {r.repo_id} has no folder {r.folder}{where}")
    if r.folder not in exports:
        names = {f[len(prefix):] for f in mine}
        lacks = [f for f in EXPORT_FILES if f not in names]
        raise HubError(f"{r}: {r.folder or 'the root'} is not a higgs-onnx export (no {', '.join(lacks)})"
                       f"{where}")
    return mine


class _Quiet:  # a tqdm class for progress=False, made on first use (tqdm is huggingface_hub's dependency)
    def __new__(cls, *args, **kwargs):
        from tqdm.auto import tqdm

        kwargs["disable"] = True
        return tqdm(*args, **kwargs)


class _errors:
    """huggingface_hub's exceptions (and a Hub out of reach) as one HubError line for `r`."""

    def __init__(self, r: HubRef, cause: str | None = None):
        self.r, self.cause = r, cause  # cause: why the Hub was not reached (the cache used instead)

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, HubError):
            return False
        message = hub_error_line(self.r, e, self.cause)
        if message is None:
            return False
        raise HubError(message) from None


def hub_error_line(r: HubRef, e: BaseException, cause: str | None = None) -> str | None:
    """The one line for what huggingface_hub raised, None for an exception that is not about the Hub."""
    from huggingface_hub import constants, errors

    endpoint = constants.ENDPOINT
    if isinstance(e, (errors.OfflineModeIsEnabled, errors.RevisionResolutionError, errors.LocalEntryNotFoundError,
                      errors.CachedRepoTreeNotFoundError, errors.IncompleteSnapshotError)) and offline():
        return f"HF_HUB_OFFLINE=1 and {r} is not in the cache ({constants.HF_HUB_CACHE}): run once online"
    if isinstance(e, errors.GatedRepoError):
        return (f"{r}: {r.repo_id} is gated: accept its terms on {endpoint}/{r.repo_id} and set HF_TOKEN to a "
                f"token of that account")
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"{r}: no repo {r.repo_id} on {endpoint} (or it is private and no token with access was sent: "
                f"set HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{r}: {r.repo_id} has no revision {r.revision!r} (a branch, tag or commit)"
    if isinstance(e, errors.RemoteEntryNotFoundError):
        return f"{r}: a file of {r.folder or 'the root'} is missing on {endpoint} ({e.__class__.__name__})"
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None and e.response.status_code in (401, 403):
        return (f"{r}: {endpoint} refused the token ({e.response.status_code}): set HF_TOKEN to a valid token "
                f"with read access to {r.repo_id}")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.CachedRepoTreeNotFoundError)):
        return f"{r}: cannot fetch it from {endpoint} ({cause or 'unreachable'}) and it is not complete in the " \
            "cache: check the network"
    if isinstance(e, (errors.HfHubHTTPError, errors.RevisionResolutionError, errors.IncompleteSnapshotError)) or \
            _is_network(e):
        cause = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        return (f"{r}: cannot fetch it from {endpoint} ({cause}); check the network, or set HF_HUB_OFFLINE=1 to "
                f"use the cache")
    return None


def _is_network(e: BaseException) -> bool:
    import httpx2

    return isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError))


# -- the doors: CLIs and the runtime -----------------------------------------------------------------------------
def local(model_path: str | os.PathLike) -> tuple[Path, HubExport | None]:
    """(the local folder, where it came from): a Hub reference fetched, a local path as it is (with its Hub origin
    when this process fetched it)."""
    if isinstance(model_path, os.PathLike) and os.fspath(model_path).startswith("hf:/"):
        raise HubError(f"{model_path}: a Path folds hf:// into hf:/: pass the Hub reference as a string: "
                       f"'hf://{os.fspath(model_path)[4:].lstrip('/')}'")
    if is_hub_ref(model_path):
        export = resolve_info(str(model_path))
        return export.path, export
    path = Path(model_path)
    return path, _RESOLVED.get(str(path.resolve())) or origin_of(path)


def origin_of(folder: Path) -> HubExport | None:
    """The Hub export a local folder is, read from its place in huggingface_hub's cache
    (`models--ORG--REPO/snapshots/<commit>/<folder>`; a repo id never holds `--`): repo, folder and commit (the
    revision is then the commit); None for a folder elsewhere (a process that fetched it knows more: `_RESOLVED`)."""
    parts = Path(os.path.abspath(folder)).parts
    if "snapshots" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("snapshots")
    if i < 1 or i + 1 >= len(parts) or not parts[i - 1].startswith("models--"):
        return None
    repo, commit = parts[i - 1][len("models--"):].replace("--", "/"), parts[i + 1]
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return None
    return HubExport(Path(folder), repo, "/".join(parts[i + 2:]), commit, commit)


def voices_dir(export: HubExport) -> Path:
    """The default saved-voices folder for a Hub export: in higgs-onnx's cache (the Hub cache is never written),
    one per repo and folder (every revision shares it: a voice records the model it was made for)."""
    from .user_cache import cache_dir

    key = "--".join([*export.repo_id.split("/"), *([export.folder.replace("/", "--")] if export.folder else [])])
    return cache_dir("voices", key)


def not_ours_to_write(folder: Path) -> bool:
    """Whether saved voices must not go into `folder/voices`: a community-layout export (a download we never write
    to, wherever it lies) or a folder this user cannot write."""
    from .foreign import is_foreign

    return folder.is_dir() and (is_foreign(folder) or not os.access(folder, os.W_OK))


def local_voices_dir(folder: Path) -> Path:
    """The default saved-voices folder for a local export we do not write to: in higgs-onnx's cache, one per folder
    (keyed by its absolute path)."""
    import hashlib

    from .user_cache import cache_dir

    where = str(folder.resolve())
    return cache_dir("voices", f"{folder.name}-{hashlib.sha256(where.encode()).hexdigest()[:12]}")


def cli_model_path(args, voices: bool = False) -> HubExport | None:
    """A command's --model-path resolved once, before any work: a Hub reference is fetched, `args.model_path`
    becomes its local folder and a line says where it came from (stderr); with `voices`, an unset `args.voices`
    becomes `voices_dir` (never inside the download)."""
    if not is_hub_ref(args.model_path):
        args.model_path = Path(args.model_path)
        if voices and getattr(args, "voices", None) is None and not_ours_to_write(args.model_path):
            args.voices = local_voices_dir(args.model_path)
        return None
    export = fetched(args.model_path)
    args.model_path = export.path
    if voices and getattr(args, "voices", None) is None:
        args.voices = voices_dir(export)
    return export


def fetched(ref: str) -> HubExport:
    """A Hub reference's export, fetched once, with a line saying where it came from (stderr)."""
    export = resolve_info(ref)
    print(f"model: {export}", file=sys.stderr, flush=True)
    return export


def local_model(model_path) -> Path:
    """A command's --model-path as its local folder: a Hub reference fetched once (`fetched`), before any work."""
    return fetched(model_path).path if is_hub_ref(model_path) else Path(model_path)


def push(folder: str | os.PathLike, repo_id: str, *, revision: str | None = None, private: bool = False,
         token: str | None = None, message: str | None = None) -> str:
    """Upload the export `folder` as the folder of the same name in `repo_id` (made if missing; `private` applies
    when it is made) in one commit, with the model card README.md regenerated from every export in the repo
    (`hub_card`); stale files of that folder are deleted. `revision`: a branch (made from main if missing).
    Returns the commit's sha."""
    folder = Path(folder).resolve()
    missing = [f for f in EXPORT_FILES if not (folder / f).is_file()]
    if missing:
        raise HubError(f"{folder} is not an export folder (no {', '.join(missing)}): build it with optimize.py")
    ref = parse(f"hf://{repo_id}/{folder.name}" + (f"@{revision}" if revision else ""))
    from .hub_fetch import quiet_hub_logging, read_manifest

    manifest = read_manifest(str(folder / "manifest.json"))
    if manifest is None:
        raise HubError(f"{folder}/manifest.json is not a JSON object: rebuild the export with optimize.py")
    if "schema_version" not in manifest:
        raise HubError(f"{folder} is not a higgs-onnx export (its manifest.json has no schema_version): only exports "
                       f"built by optimize.py are pushed")
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.hf_api import RepoFile

    quiet_hub_logging()
    here = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))  # flat, as fetched
    size = sum(p.stat().st_size for p in here)
    print(f"pushing {folder} to {ref}: {len(here)} files, {size / (1 << 20):.1f} MB (Ctrl-C stops it; nothing is "
          f"committed until the end)", flush=True)

    api = HfApi(token=token)
    with _write_errors(ref):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        remote = [f.path for f in api.list_repo_tree(repo_id, recursive=True, revision=revision)
                  if isinstance(f, RepoFile)]
        manifests = {d: _remote_manifest(repo_id, d, revision, token) for d in export_folders(remote)
                     if d and d != folder.name}
    manifests[folder.name] = manifest
    ops = [CommitOperationAdd(f"{folder.name}/{p.name}", str(p)) for p in here]
    names = {p.name for p in here}
    ops += [CommitOperationDelete(f) for f in remote
            if f.startswith(f"{folder.name}/") and f[len(folder.name) + 1:] not in names]
    from .hub_card import card, licence_of

    ops.append(CommitOperationAdd("README.md", card(repo_id, manifests, licence_of(manifest)).encode()))
    with _write_errors(ref):
        info = api.create_commit(repo_id, ops, revision=revision,
                                 commit_message=message or f"{folder.name}: higgs-onnx export "
                                 f"({manifest.get('device')} {manifest.get('precision')})")
    print(f"pushed {folder} -> hf://{repo_id}/{folder.name}{'@' + revision if revision else ''} "
          f"(commit {info.oid[:12]})", flush=True)
    return info.oid


def _remote_manifest(repo_id: str, folder: str, revision: str | None, token: str | None) -> dict:
    from huggingface_hub import hf_hub_download

    from .hub_fetch import read_manifest

    return read_manifest(hf_hub_download(repo_id, f"{folder}/manifest.json", revision=revision, token=token)) or {}


class _write_errors:
    def __init__(self, ref: HubRef):
        self.ref = ref

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, HubError):
            return False
        from huggingface_hub import errors

        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, errors.RepositoryNotFoundError) or status in (401, 403):
            raise HubError(f"{self.ref}: the Hub refused to write to {self.ref.repo_id} ({status}): set HF_TOKEN to a "
                           f"token with write access to {self.ref.repo_id.split('/')[0]}") from None
        from .hub_fetch import unreachable

        if unreachable(e) or isinstance(e, errors.HfHubHTTPError):
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise HubError(f"{self.ref}: the upload to {self.ref.repo_id} failed ({cause}); nothing was committed: "
                           f"run again") from None
        line = hub_error_line(self.ref, e)
        if line is None:
            return False
        raise HubError(line) from None
