"""A long-form job's files, checked before any work: the text file read as text (byte-order marks, UTF-16 without
one, binary and empty files refused in one line), the output and its work folder (`<out>.work`), and the lock a
running job holds on them."""

from __future__ import annotations

import codecs
import os
from pathlib import Path

from ..outputs import check_output_file, probe_writable

LOCK = "lock"  # in the work folder: held (flock) while a job runs on this output


class JobLockedError(FileExistsError):
    """Another long-form job is working on the same output right now."""


# -- the text file ---------------------------------------------------------------------------------------------------
# byte-order marks, longest first (the UTF-32-LE mark starts with the UTF-16-LE one)
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
         (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"))


def _utf16_without_bom(data: bytes) -> str | None:
    """"UTF-16LE"/"UTF-16BE" when `data` looks like mostly-ASCII UTF-16 without a byte-order mark, else None."""
    if len(data) < 4 or len(data) % 2:
        return None
    even, odd = data[0::2], data[1::2]
    for name, zeros, chars in (("UTF-16LE", odd, even), ("UTF-16BE", even, odd)):
        if zeros.count(0) >= 0.9 * len(zeros) and chars.count(0) <= 0.1 * len(chars):
            return name
    return None


MAX_TEXT_BYTES = 64 << 20  # a long novel is ~1-2 MB of text


def read_text_file(path: str | os.PathLike, flag: str = "--text-file") -> str:
    """A text file for long-form: UTF-8 (with or without a byte-order mark), or UTF-16 / UTF-32 with one. Refused
    with one clear line when it is empty, binary, or in another encoding (naming the likely one and the command that
    converts it)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder")
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path} does not exist")
    try:  # a regular file, or a pipe / process substitution / /dev/stdin: read up to a bound, never forever
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
        if len(data) > MAX_TEXT_BYTES:
            what = "a binary file, not text" if b"\x00\x00\x00\x00" in data else \
                f"larger than {MAX_TEXT_BYTES >> 20} MB; split it into chapters"
            raise ValueError(f"{flag} {path} is {what}")
    except OSError as e:
        raise PermissionError(f"{flag} {path} cannot be read ({e.strerror or type(e).__name__})") from None
    bom = next(((enc, label) for mark, enc, label in _BOMS if data.startswith(mark)), None)
    if bom is not None:
        enc, label = bom
        try:
            text = data.decode(enc)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} starts with a {label} byte-order mark but is not valid {label} text (byte "
                             f"{e.start}); convert it, e.g. iconv -f {label} -t UTF-8") from None
    else:
        if b"\x00" in data:
            guess = _utf16_without_bom(data)
            if guess:
                raise ValueError(f"{path} looks like {guess} text without a byte-order mark; convert it, e.g. "
                                 f"iconv -f {guess} -t UTF-8")
            raise ValueError(f"{path} is a binary file, not text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); convert "
                             f"it, e.g. iconv -f latin1 -t utf-8") from None
    if "\x00" in text:
        raise ValueError(f"{path} is a binary file, not text")
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def check_outputs(out: str | os.PathLike, flag: str = "--out") -> Path:
    """What a long-form job on `out` needs, checked before the model is loaded: `out` a writable audio file name,
    and its work folder (`<out>.work`) creatable or a writable folder. Nothing is created."""
    from ..audio import WRITE_FORMATS

    out = check_output_file(out, flag, suffixes=tuple(WRITE_FORMATS))
    work = work_folder(out)
    if work.exists() and not work.is_dir():
        raise NotADirectoryError(f"{flag} {out}: its work folder {work} is a file; move it away")
    if work.is_dir():
        probe_writable(work, f"{flag} {out}: work folder")
    return out


def check_not_locked(out: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse a one-shot output that a running long-form job will replace when it finishes (its lock is held)."""
    from filelock import FileLock, Timeout

    lock_path = work_folder(Path(out)) / LOCK
    if not lock_path.is_file():
        return
    lock = FileLock(str(lock_path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise JobLockedError(f"{flag} {out}: a long-form job is writing this file right now (it holds {lock_path}) "
                             f"and would replace it when it finishes; choose another {flag}") from None
    except OSError:
        return
    lock.release()


def work_folder(out: Path) -> Path:
    return out.with_name(out.name + ".work")
