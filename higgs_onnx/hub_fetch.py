"""How `hub.resolve_info` fetches a folder: the revision resolved (the cache's when the Hub cannot be reached, said in
one line), the repo's file list (huggingface_hub's tree cache when it holds that commit: no network call), the
files a community-layout manifest names, and each file downloaded in this thread (Ctrl-C stops it at once; the
next run resumes), an LFS file fetched this time checked against its sha256 (a corrupt download never stays).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)


class HubError(ValueError):
    """A Hub reference that cannot be used or fetched: one line that says what to do (`hub` re-exports it)."""


MANIFEST = "manifest.json"
SIX = ("text_embed", "audio_encoder", "audio_embed", "llm_decoder", "audio_heads", "audio_tokenizer")


def quiet_hub_logging() -> None:
    """huggingface_hub's log records go through the root logger once (its own stderr handler removed), at ERROR
    unless the root logger is at INFO or DEBUG (--log-level): its retries and fallbacks are not ours to print."""
    hf = logging.getLogger("huggingface_hub")
    for h in list(hf.handlers):
        hf.removeHandler(h)
    hf.propagate = True
    hf.setLevel(logging.NOTSET if logging.getLogger().getEffectiveLevel() <= logging.INFO else logging.ERROR)


def unreachable(e: BaseException) -> bool:
    """The Hub could not be reached or is down (a network error, a timeout, a 5xx), not an answer about the repo."""
    import httpx2
    from huggingface_hub import errors

    if isinstance(e, httpx2.ProxyError):
        return False
    status = getattr(getattr(e, "response", None), "status_code", None)
    return isinstance(e, (httpx2.TransportError, ConnectionError, TimeoutError)) or \
        (isinstance(e, errors.HfHubHTTPError) and status is not None and status >= 500)


def resolve(api, r, token, offline: bool):
    """(the revision resolved to its commit, None) online; offline, or when the Hub cannot be reached or is down
    and the cache knows the revision: (the cache's, why the Hub was not used: "" offline, else the cause)."""
    if offline:
        return api.resolve_revision(r.repo_id, revision=r.revision, token=token, local_files_only=True), ""
    try:
        api.repo_info(r.repo_id, revision=r.revision, token=token)
    except Exception as e:  # noqa: BLE001 - only an unreachable Hub falls back; anything else is raised as it is
        if not unreachable(e):
            raise
        from huggingface_hub import errors

        try:
            rev = api.resolve_revision(r.repo_id, revision=r.revision, token=token, local_files_only=True)
        except errors.RevisionResolutionError:
            raise e from None
        return rev, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return api.resolve_revision(r.repo_id, revision=r.revision, token=token), None


def listing(api, r, rev, cached_only: bool) -> dict[str, str | None]:
    """{path: the LFS sha256 or None} of the repo's files at the commit: from huggingface_hub's tree cache when it
    holds that commit (a commit's tree never changes), else from the Hub (then kept in that cache)."""
    from huggingface_hub import constants
    from huggingface_hub._tree_cache import TreeCacheEntry, read_tree_cache, write_tree_cache
    from huggingface_hub.file_download import repo_folder_name

    folder = os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=r.repo_id, repo_type="model"))
    entries = read_tree_cache(folder, rev.resolved)
    if entries is None:
        if cached_only:
            from huggingface_hub.errors import CachedRepoTreeNotFoundError

            raise CachedRepoTreeNotFoundError(f"no cached file list of {r.repo_id} at {rev.resolved}")
        from huggingface_hub.hf_api import RepoFile

        entries = {f.path: TreeCacheEntry(size=f.size, blob_id=f.blob_id, lfs_sha256=f.lfs.sha256 if f.lfs else None,
                                          lfs_size=f.lfs.size if f.lfs else None, xet_hash=f.xet_hash)
                   for f in api.list_repo_tree(r.repo_id, recursive=True, revision=rev.resolved)
                   if isinstance(f, RepoFile)}
        try:
            write_tree_cache(folder, rev.resolved, entries)
        except OSError as e:  # a read-only cache: the listing is asked again next time
            log.info("could not keep the file list of %s: %s", r.repo_id, e)
    return {p: e.lfs_sha256 for p, e in entries.items()}


def community_files(r, files: dict, theirs: dict) -> list[str] | None:
    """The files a community-layout manifest (`theirs`: no schema_version, `sub_models`) needs, as repo paths: each
    part's graph (its `filename`, else `<part>.onnx`; in its `standalone_dir` when not beside the manifest; the
    rules of `foreign._part_files`), the files beside a graph whose names start with the graph's (its external
    data), the decoder's `genai_config.json`, `tokenizer.json`, the manifest. None when `theirs` is not that layout;
    a part the listing lacks is a HubError line."""

    subs = theirs.get("sub_models") if isinstance(theirs, dict) and "schema_version" not in theirs else None
    if not isinstance(subs, dict):
        return None
    prefix = f"{r.folder}/" if r.folder else ""
    where = r.folder or "the root"
    out = [prefix + MANIFEST]
    for part in SIX:
        entry = subs.get(part, {})
        name = entry.get("filename", f"{part}.onnx") if isinstance(entry, dict) else None
        sub = entry.get("standalone_dir") if isinstance(entry, dict) else None
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise HubError(f"{r}: {where}/{MANIFEST}: {part}'s filename {name!r} is not a plain file name")
        if isinstance(sub, str) and prefix + name not in files:
            sub = sub.rstrip("/")
            if os.path.basename(sub) != sub or sub in ("", ".", ".."):
                raise HubError(f"{r}: {where}/{MANIFEST}: {part}'s standalone_dir {sub!r} is not a sub-folder name")
            name = f"{sub}/{name}"
        graph = prefix + name
        if graph not in files:
            raise HubError(f"{r}: {where} is a community-layout export without its {part} part ({name})")
        out += [f for f in files if PurePosixPath(f).parent == PurePosixPath(graph).parent and f.startswith(graph)]
        if part == "llm_decoder":
            genai = str(PurePosixPath(graph).parent / "genai_config.json")
            out += [genai] if genai in files else []
            sub_tok = str(PurePosixPath(graph).parent / "tokenizer.json")
            out += [prefix + "tokenizer.json"] if prefix + "tokenizer.json" in files else \
                ([sub_tok] if sub_tok in files else [])
    return sorted(set(out))


def read_manifest(path: str) -> dict | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def drop(path: str) -> None:
    """A file of the Hub cache removed: its snapshot link and the blob it points at."""
    blob = os.path.realpath(path)
    for p in {path, blob}:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def fetch(r, rev, wanted: list[str], lfs: dict, *, token, cached_only: bool, tqdm_class) -> Path:
    """Each of `wanted` downloaded in this thread (a file already in the cache at that commit is reused without a
    network call); an LFS file fetched this time whose bytes do not hash to its sha256 is removed and fetched
    once more, then refused. Returns the snapshot folder."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache


    root = None
    for f in wanted:
        def get(force: bool = False, f: str = f) -> str:
            return hf_hub_download(r.repo_id, f, revision=rev, token=token, local_files_only=cached_only,
                                   force_download=force, tqdm_class=tqdm_class)

        had = isinstance(try_to_load_from_cache(r.repo_id, f, revision=rev.resolved), str)
        path = get()
        want = lfs.get(f)
        if not had and want:
            for attempt in (1, 2):
                got = sha256_of(path)
                if got == want:
                    break
                drop(path)
                if attempt == 2:
                    raise HubError(f"{r}: the Hub served a corrupt {f} (sha256 {got[:12]}…, its listing says "
                                   f"{want[:12]}…): removed from the cache; run again")
                log.info("%s: %s arrived corrupt (sha256 %s): fetching it again", r, f, got[:12])
                path = get(force=True)
        root = Path(path).parents[f.count("/")]
    return root
