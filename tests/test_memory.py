"""Process memory helpers: the page reclaimer that keeps ModelBuilder's memory maps from filling the RSS."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from higgs_onnx.memory import DropMappedPages, peak_rss, release_memory, rss


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux only")
def test_mapped_pages_are_reclaimed_and_their_contents_kept(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")  # private and writable, like safetensors' maps
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page touched
    before = _rss_file()
    dropper = DropMappedPages(path, interval=0.05)
    if dropper.madvise is None or dropper.drop() == 0:
        pytest.skip("this kernel refuses MADV_PAGEOUT")
    after = _rss_file()  # the kernel reclaims the pages inside the madvise call: nothing to wait for
    assert before - after > 48 << 20, (before, after)  # the 64 MB map left the resident set
    assert np.array_equal(mapped, data)  # and reads back unchanged
    # the thread: a spy on `drop` (not a sleep) shows it advises the map again while the block runs, then stops
    dropped, real_drop = threading.Event(), dropper.drop
    calls = []

    def spy() -> int:
        calls.append(real_drop())
        dropped.set()
        return calls[-1]

    dropper.drop = spy
    with dropper:
        assert mapped.sum(dtype=np.int64) > 0  # touch every page again
        assert dropped.wait(timeout=60), "the thread never called drop()"  # a hang guard, not a timing check
    assert calls and calls[0] > 0  # the kernel accepted the advice for the map
    assert dropper.thread is not None and not dropper.thread.is_alive()  # stopped with the block


def test_memory_figures():
    release_memory()
    assert 0 < rss() <= peak_rss()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_peak_rss_is_this_process_high_water_mark_not_its_parents():
    """`peak_rss` reads VmHWM, as its docstring says: a child started while its parent holds 400 MB reports its own
    peak (tens of MB), where getrusage's ru_maxrss, which survives exec, reports the parent's 400 MB."""
    import subprocess

    held = np.ones(400 << 20, dtype=np.uint8)  # touched: resident in this process
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    assert abs(peak_rss() - hwm) < 16 << 20 and peak_rss() > 400 << 20
    code = ("import resource; from higgs_onnx.memory import peak_rss; "
            "print(peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    child, maxrss = map(int, r.stdout.split())
    assert child < 200 << 20 and maxrss > 400 << 20, (child, maxrss, held.size)
