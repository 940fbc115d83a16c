"""Process memory: what this process holds, and giving back what it no longer needs.

A 4B export must fit a 16 GB laptop (about 10 GB free with a browser open), so optimize.py keeps its whole-run
peak resident set under 8 GB and says at every step what it holds (`rss`, `peak_rss`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)
MADV_PAGEOUT = 21  # <sys/mman.h>, Linux >= 5.4: reclaim these pages; their contents stay as they are


def rss() -> int:
    """Resident set size of this process now (bytes)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    """The most memory this process has held (bytes): VmHWM of /proc/self/status on Linux, the peak working set on
    Windows, getrusage's ru_maxrss elsewhere (macOS). Not ru_maxrss on Linux: it survives exec, so a process that a
    large one started (a CLI, a corpus worker, a benchmark's child) would report its parent's peak as its own."""
    if sys.platform.startswith("linux"):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    import psutil

    info = psutil.Process().memory_info()
    if hasattr(info, "peak_wset"):
        return int(info.peak_wset)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def trim_heap() -> None:
    """Hand freed heap pages back to the OS: glibc keeps them for reuse otherwise, so a process that frees a few
    hundred MB at a time (a streamed layer) would keep its high-water mark."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to trim
        pass


def release_memory() -> None:
    """Collect reference cycles and trim the heap, so one step's garbage does not add to the next step's peak."""
    gc.collect()
    trim_heap()


class DropMappedPages:
    """While active, a thread reclaims this process's pages of memory maps of `path` every `interval` s.

    Why: ModelBuilder loads the checkpoint through memory maps and touches every weight once while it writes the
    fp32 graph; the touched pages stay mapped, so a 4B build's resident set grows by the whole bf16 body (7.3 GB)
    although each weight is needed for a moment only. `madvise(MADV_PAGEOUT)` reclaims pages without changing what
    the memory holds: a clean page is read from the file again when touched, a page written since it was mapped
    (copy-on-write) could only go to swap and simply stays. So the advice is safe for any mapping, even one that
    changed under the thread (the safetensors maps are private and writable). Linux only; elsewhere (or on older
    kernels, which refuse the advice) this does nothing and the build just holds more.
    """

    def __init__(self, path: Path, interval: float = 0.5):
        self.path, self.interval = str(Path(path).resolve()), interval
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.madvise = None
        if sys.platform.startswith("linux"):
            try:
                self.madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
                self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            except (OSError, AttributeError):
                self.madvise = None

    def regions(self) -> list[tuple[int, int]]:
        out = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == self.path:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    out.append((start, end))
        return out

    def drop(self) -> int:
        """Advise every mapping of the file once; returns the bytes the kernel accepted the advice for."""
        done = 0
        for start, end in self.regions():
            if self.madvise(start, end - start, MADV_PAGEOUT) == 0:
                done += end - start
        return done

    def _loop(self) -> None:
        while not self.stop.wait(self.interval):
            self.drop()

    def __enter__(self) -> DropMappedPages:
        if self.madvise is not None:
            self.thread = threading.Thread(target=self._loop, name="drop-mapped-pages", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
