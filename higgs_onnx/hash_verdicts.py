"""The export's files hashed once per file identity, not at every load (7.5 GB took seconds on the 4b).

A verdict is a file's sha256 as computed for one identity of that file: its resolved path, size, mtime_ns,
ctime_ns, inode and device (`identity`). While every field is the same, the file is the one that was hashed: the
verdict's sha256 stands for it. Any change (a byte written changes the mtime and the ctime; a copy or a
replacement changes the inode; even `touch -d` that puts the old mtime back changes the ctime) makes it a new
file, hashed again and refused as before when its sha256 is not the manifest's.

The verdicts live beside the export (`VERDICTS`, a dot file: `optimize.py --push-to-hub` leaves it out) where the
folder can be written, else (a folder in the Hub's cache, a read-only mount) in the user's cache, under a key of the
folder's resolved path. Written atomically; a verdict file that cannot be read, one larger than `MAX_BYTES` or not a
regular file (a FIFO, a link to /dev/zero), or one whose entries are not what this module writes, is ignored (every
file hashed again), never trusted; one that cannot be written costs the next load a hash, nothing else. A verdict
only vouches for a file: one that disagrees with the sha256 the manifest expects is not believed (the file is
hashed), so a verdict file edited or damaged can make a load hash again, never refuse a sound file.

    verdicts = Verdicts(folder, shared=False)   # shared: a download in the Hub's cache (never written into)
    verdicts.matches(path, sha256) # whether the file's sha256 is this one: the verdict's while the identity holds,
                                   # else computed (and recorded)
    verdicts.save()                # the new verdicts written (a no-op when nothing was hashed)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from .outputs import write_atomic
from .user_cache import CacheError, cache_dir, read_kept

log = logging.getLogger(__name__)

VERDICTS = ".higgs-verified.json"  # beside the export; a dot file, so never pushed to the Hub with it
CACHE_KIND = "verdicts"  # <user cache>/verdicts/<key of the folder>/VERDICTS for a folder that cannot be written
VERSION = 1  # bump when an entry's fields change: older files are then ignored (hashed again)
IDENTITY = ("path", "size", "mtime_ns", "ctime_ns", "ino", "dev")
MAX_BYTES = 2**24  # a verdict file larger than this is not read (an entry is ~250 bytes: 60,000 files)


def identity(path: Path) -> dict:
    """What makes a file the same file: its resolved path, size, mtime_ns, ctime_ns, inode and device (a link
    followed: a Hub snapshot's file is its blob)."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


def sha256_file(path: Path, chunk: int = 2**24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verdict_file(folder: Path, shared: bool) -> Path:
    """Where the folder's verdicts are kept: beside the export when the folder can be written and is not `shared`
    (a download in the Hub's cache, never written into), else in the user's cache (the path only: made when
    written). A folder whose mode grants no write is read-only here even to root, whom the mode does not stop."""
    if os.access(folder, os.W_OK | os.X_OK) and folder.stat().st_mode & 0o222 and not shared:
        return folder / VERDICTS
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return cache_dir(CACHE_KIND, key, make=False) / VERDICTS


def _read(path: Path) -> dict[str, dict]:
    """The verdicts in `path` by resolved file path; {} when missing, unreadable, too large, not a regular file or
    not of this version."""
    text = read_kept(path, MAX_BYTES)
    try:
        data = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("files"), list):
        return {}
    kept = {}
    for entry in data["files"]:
        if (isinstance(entry, dict) and set(entry) == {*IDENTITY, "sha256"} and isinstance(entry["sha256"], str)
                and len(entry["sha256"]) == 64 and isinstance(entry["path"], str)
                and all(type(entry[k]) is int for k in IDENTITY[1:])):
            kept[entry["path"]] = entry
    return kept


class Verdicts:
    """The verdicts of one export folder: read once, added to as files are hashed, written by `save`."""

    def __init__(self, folder: Path, shared: bool = False):
        self.folder = Path(folder)
        try:
            self.file = verdict_file(self.folder, shared)
        except ValueError:  # the cache's path cannot be formed: hash every time
            self.file = None
        self.known = _read(self.file) if self.file is not None else {}
        self.hashed: dict[str, dict] = {}

    def matches(self, path: Path, sha256: str) -> bool:
        """Whether `path`'s sha256 is `sha256` (what the manifest records): yes while the file's identity is the one
        a verdict of that sha256 was computed for, else the file hashed now (its verdict kept for `save` when the
        file did not change while it was read)."""
        before = identity(path)
        known = self.known.get(before["path"])
        if known is not None and known["sha256"] == sha256 and all(known[k] == before[k] for k in IDENTITY):
            return True
        digest = sha256_file(path)
        if identity(path) == before:
            self.hashed[before["path"]] = {**before, "sha256": digest}
        return digest == sha256

    def save(self) -> None:
        """Write the verdicts (the known ones of files still there, the new ones) atomically; nothing when no file
        was hashed. A folder or cache that cannot be written is said at debug level: the next load hashes again."""
        if not self.hashed or self.file is None:
            return
        merged = {p: e for p, e in self.known.items() if os.path.exists(p)}
        merged.update(self.hashed)
        body = json.dumps({"version": VERSION, "files": sorted(merged.values(), key=lambda e: e["path"])}, indent=1)
        try:
            if self.file.parent != self.folder:
                cache_dir(CACHE_KIND, self.file.parent.name)  # made (and checked writable) on first use
            write_atomic(self.file, body + "\n")
        except (OSError, CacheError) as e:
            log.debug("the files' verdicts cannot be kept in %s (%s): the next load hashes them again", self.file, e)
