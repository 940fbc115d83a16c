"""Output paths, checked before any work, and audio that is never lost when writing it fails at the end.

Every job calls `check_output_file` / `check_output_dir` for each place it will write *before it loads the model*:
a folder given as a file, a missing or unwritable folder, an unknown extension are one clear line, not an error after
minutes of generation. Writability is probed by creating (and removing) a file in the folder, because `os.access`
says yes to root for read-only or virtual file systems (`/proc`, a read-only mount).

If writing still fails at the end (disk full, the folder removed meanwhile), `keep_audio` saves the audio in the
system's temporary folder and the error names both the user's path and where the audio is. New files follow the
umask, and a file that is overwritten keeps its permissions.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def check_output_dir(path: str | os.PathLike, flag: str, create: bool = True) -> Path:
    """A folder the job will write into: created if missing (with `create`), refused when it names a file or cannot
    be written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {path} is a file, not a folder")
    if not path.exists():
        if not create:
            raise FileNotFoundError(f"{flag}: folder {path} does not exist")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"{flag} {path}: cannot create this folder ({_reason(e)})") from None
    probe_writable(path, flag)
    return path


def probe_writable(folder: Path, flag: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".higgs-write-probe.", dir=folder)
    except OSError as e:
        raise PermissionError(f"{flag}: cannot write in {folder} ({_reason(e)})") from None
    os.close(fd)
    os.unlink(name)


def check_output_file(path: str | os.PathLike, flag: str, suffixes=None, example: str = "out.wav") -> Path:
    """A file the job will write: its folder must exist and be writable, `path` must not be a folder, and its
    extension must be one of `suffixes` (when given)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder, not a file: name a file in it (e.g. {path / example})")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {path}: unsupported format {path.suffix or '(no extension)'!r}; use one of "
                         f"{', '.join(suffixes)}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise NotADirectoryError(f"{flag} {path}: {parent} is a file, not a folder")
    if not parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: folder {parent} does not exist")
    if path.exists() and not path.is_file():
        raise ValueError(f"{flag} {path} exists and is not a regular file")
    probe_writable(parent, flag)
    return path


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Write a file whole or not at all, the one way every writer here does it: yields a temporary path beside
    `path` (hidden, unique, ending in `.partial` + `suffix` for writers that choose the format by the extension),
    renamed over `path` when the block ends, with the mode `path` has (or the umask's); removed if the block fails."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial" + suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        set_mode(tmp, path)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """`data` (text as UTF-8) written to `path` through `atomic`."""
    with atomic(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def set_mode(tmp: str | os.PathLike, target: Path) -> None:
    """Give a temp file (mkstemp makes them 0600) the mode `target` has, or the umask's for a new file."""
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except OSError:
        mode = 0o666 & ~current_umask()
    os.chmod(tmp, mode)


def keep_audio(wav: np.ndarray, sr: int, target: Path) -> Path | None:
    """Save audio that could not be written to `target` in the temporary folder; its path (None if that failed too)."""
    import soundfile as sf

    name = f"higgs-kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{Path(target).stem or 'audio'}.wav"
    path = Path(tempfile.gettempdir()) / name
    try:
        sf.write(path, np.clip(wav, -1.0, 1.0), sr, format="WAV", subtype="PCM_16")
    except Exception:  # noqa: BLE001 - nowhere left to put it; the caller says so
        return None
    return path


class OutputError(OSError):
    """Writing a finished output failed; the message names the target and where the work was kept."""


def write_or_keep(write, wav: np.ndarray, sr: int, target: Path) -> Path:
    """`write()` the output; if it fails, keep the audio (`keep_audio`) and raise OutputError naming both."""
    try:
        return write()
    except OSError as e:
        kept = keep_audio(wav, sr, target)
        where = f"the audio is kept in {kept}" if kept else "the audio could not be kept anywhere"
        raise OutputError(f"cannot write {target} ({_reason(e)}); {where}") from None
