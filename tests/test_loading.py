"""Loading apart from generation: the int4 decoder's prepared graph (runtime/prepared.py: made once, gated bit-equal
to the original's outputs, used from then on; a copy that differs is dropped; a damaged one, or one a killed process
left half-made, never fails a load nor changes its outputs) and the load kept out of a request's figures
(GenerationStats.load_s, the CLI's one-line summary)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from higgs_onnx.generation.engine import GenerationStats
from higgs_onnx.runtime import prepared
from higgs_onnx.speak import summary

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def entry_of(cache) -> tuple:
    """(the one prepared entry's folder, its state)."""
    folder, = (cache / prepared.CACHE_KIND).iterdir()
    return folder, json.loads((folder / prepared.STAMP).read_text())["state"]


def greedy(folder, **kw) -> tuple:
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, verify=False, route="off", **kw)
    rows = tts.generate("Loading is not speaking.", seed=3, temperature=0, max_rows=24).rows
    return tts.backend.decoder.part.path, rows


def test_the_prepared_graph_is_made_once_gated_and_then_used(builds, tmp_path, monkeypatch):
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    folder = builds["int4"]
    monkeypatch.setenv(prepared.ENV, "0")
    original, rows = greedy(folder)
    assert original == folder / "llm_step.onnx" and not (tmp_path / "cache" / prepared.CACHE_KIND).exists()
    monkeypatch.delenv(prepared.ENV)
    path, first = greedy(folder)  # the first load: the original's session, writing the prepared copy
    entry, state = entry_of(tmp_path / "cache")
    assert path == original and state == "unchecked" and (entry / "llm_step.onnx.data").is_file()
    for expected in ("equal", "equal"):  # the second load checks it, the third just uses it
        path, again = greedy(folder)
        assert path == entry / "llm_step.onnx" and entry_of(tmp_path / "cache")[1] == expected
        assert np.array_equal(again, rows) and np.array_equal(first, rows)


def test_a_prepared_graph_that_differs_is_dropped(builds, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "export"
    shutil.copytree(builds["int4"], folder)  # an entry of its own (other file identities)
    _, rows = greedy(folder)
    entry, _ = entry_of(tmp_path / "cache")
    kept = np.load(entry / prepared.PROBE)
    np.savez(entry / prepared.PROBE, *[kept[k] + 1 for k in kept.files])  # what the original "gave" is now other
    with caplog.at_level(logging.WARNING, logger="higgs_onnx.runtime.prepared"):
        path, again = greedy(folder)
    assert path == folder / "llm_step.onnx" and entry_of(tmp_path / "cache")[1] == "differs"
    assert "outputs differ from the original graph's: the original is loaded" in caplog.text
    assert not (entry / "llm_step.onnx.data").exists() and np.array_equal(again, rows)
    assert greedy(folder)[0] == folder / "llm_step.onnx"  # and later


def truncate(path: Path) -> None:
    path.write_bytes(b"")


def flip_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0x5A for b in data[len(data) // 2:len(data) // 2 + 64])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", [truncate, flip_keeping_size_and_mtime])
def test_a_damaged_prepared_graph_is_prepared_again_never_failing_a_load(builds, tmp_path, monkeypatch, caplog,
                                                                         damage):
    """A checked ("equal") copy whose data file was emptied (a full disk, a cleaner) failed the load; one changed in
    place at the same size and mtime was used, with other outputs. Its files' identities are in its stamp now."""
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    folder = builds["int4"]
    _, rows = greedy(folder)
    greedy(folder)
    entry, state = entry_of(tmp_path / "cache")
    assert state == "equal"
    damage(entry / "llm_step.onnx.data")
    with caplog.at_level(logging.WARNING, logger="higgs_onnx.runtime.prepared"):
        path, again = greedy(folder)
    assert "changed since it was written: prepared again" in caplog.text
    assert path == folder / "llm_step.onnx" and np.array_equal(again, rows)
    assert entry_of(tmp_path / "cache")[1] == "unchecked"  # made anew, checked by the next load
    path, again = greedy(folder)
    assert path == entry / "llm_step.onnx" and np.array_equal(again, rows)


@pytest.mark.timeout(60)
def test_a_stamp_that_is_no_regular_file_is_not_read(builds, tmp_path, monkeypatch):
    """A FIFO in place of an entry's stamp blocked the load forever (user_cache.read_kept): now the entry is
    prepared anew."""
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    folder = builds["int4"]
    _, rows = greedy(folder)
    entry, _ = entry_of(tmp_path / "cache")
    (entry / prepared.STAMP).unlink()
    os.mkfifo(entry / prepared.STAMP)
    path, again = greedy(folder)
    assert path == folder / "llm_step.onnx" and np.array_equal(again, rows)
    assert entry_of(tmp_path / "cache")[1] == "unchecked"


def test_a_prepare_killed_midway_leaves_nothing_a_load_reads(builds, tmp_path, monkeypatch):
    """SIGKILL after ONNX Runtime wrote the copy, before its stamp: the half-made entry is a temporary folder no load
    opens, removed by the next prepare (its lock is no longer held), which makes the entry anew."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HIGGS_CACHE", str(cache))
    folder = builds["int4"]
    code = ("import os, signal, sys; from higgs_onnx.runtime import prepared; "
            "prepared.files_of = lambda folder: os.kill(os.getpid(), signal.SIGKILL); "
            "from higgs_onnx.runtime.parts import ModelParts; ModelParts(sys.argv[1], threads=1).part('llm_step')")
    r = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left, = (cache / prepared.CACHE_KIND).iterdir()
    assert left.name.endswith(".partial") and (left / "llm_step.onnx.data").is_file()
    monkeypatch.setenv(prepared.ENV, "0")
    _, rows = greedy(folder)
    monkeypatch.delenv(prepared.ENV)
    path, first = greedy(folder)
    entry, state = entry_of(cache)  # the one folder left: the dead process's is gone
    assert path == folder / "llm_step.onnx" and state == "unchecked" and np.array_equal(first, rows)
    assert greedy(folder)[0] == entry / "llm_step.onnx" and entry_of(cache)[1] == "equal"


def test_a_session_made_inside_a_call_is_load_not_generation(builds):
    """The route's session made by the first call that takes it: counted in load_s, not in prefill_s or the RTF."""
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(builds["int4"], verify=False, route="on")
    tts.preload(("text_embed", "audio_heads", "audio_tokenizer"))
    assert "llm_route" not in tts.parts.loaded()
    before = tts.parts.load_s
    stats = tts.generate("Loading is not speaking.", seed=3, temperature=0, max_rows=24).stats
    made = tts.parts.load_s - before  # the route's session alone
    assert "llm_route" in tts.parts.loaded() and made > 0 and stats.load_s == pytest.approx(made)
    assert stats.rtf == pytest.approx((stats.wall_s - stats.load_s) / stats.audio_s)
    assert tts.load_s == pytest.approx(tts.opened_s + tts.parts.load_s) and tts.opened_s > 0
    for live in (False, True):  # the first call makes every session it needs: all of them load, none generation
        fresh = HiggsTTS(builds["int4"], verify=False, route="off")
        text = "Loading is not speaking."
        if live:
            *_, last = fresh.stream(text, seed=3, temperature=0, max_rows=24)
            stats = last.stats
        else:
            stats = fresh.generate(text, seed=3, temperature=0, max_rows=24).stats
        assert {"llm_step", "text_embed", "audio_heads"} < set(fresh.parts.loaded())
        assert stats.load_s == pytest.approx(fresh.parts.load_s) and stats.load_s > 0


def test_the_summary_splits_generation_and_puts_the_load_apart():
    stats = GenerationStats(prompt_tokens=9, reference_rows=0, rows=57, frames=50, audio_s=2.0, voice_s=0.0,
                            prefill_s=0.5, decode_s=2.5, codec_s=0.25, first_row_s=0.5, first_audio_s=4.5, wall_s=4.5,
                            chunks=1, stop_reason="eoc", load_s=1.0)
    assert stats.rtf == 1.75
    assert summary(stats, 6.25, live=False) == (
        "2.00 s audio in 3.50 s (RTF 1.75: prefill 0.50 s, decode 2.50 s, codec 0.25 s); load 6.25 s apart; "
        "first row after 0.50 s; 57 rows; stop: eoc")


def test_the_out_dir_and_long_form_summaries_put_the_load_apart(builds, tmp_path, monkeypatch, capsys):
    """`--text-file` with `--out-dir` (with --lanes: no batch-gain measure first) and with `--out` made the sessions
    inside their timing: the load was in their generation time and RTF (tiny: 0.3 s, RTF 0.15, against 0.1 s and
    0.07 with the load apart). Each session made 0.3 s slower here: the load grows, the generation does not."""
    import inference
    from higgs_onnx.runtime.parts import ModelParts

    real = ModelParts._open
    monkeypatch.setattr(ModelParts, "_open", lambda self, *a: time.sleep(0.3) or real(self, *a))
    monkeypatch.setenv("HIGGS_CACHE", str(tmp_path / "cache"))
    lines = tmp_path / "lines.txt"
    lines.write_text("First line here.\nSecond line there.\n")
    for out in (["--out-dir", tmp_path / "out", "--lanes", 2], ["--out", tmp_path / "long.wav"]):
        args = ["--model-path", builds["int4"], "--text-file", lines, *out, "--max-rows", 60, "--seed", 3]
        assert inference.main([str(a) for a in args]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        made, load = re.search(r" in ([\d.]+) s \(RTF [\d.]+; load ([\d.]+) s apart\)", last).groups()
        assert float(load) >= 0.9 and float(made) < 0.9, last  # three sessions or more, each 0.3 s, made meanwhile


def test_entries_of_changed_or_deleted_graphs_are_removed(builds, tmp_path, monkeypatch):
    """A rebuilt graph (another identity at the same path) and a graph that is gone leave no entry behind: each
    holds GBs for the 4b, and no load could use them again."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HIGGS_CACHE", str(cache))
    folder = tmp_path / "export"
    shutil.copytree(builds["int4"], folder)
    greedy(folder)
    old, _ = entry_of(cache)
    orphan = cache / prepared.CACHE_KIND / ("0" * 32)  # made for a staging folder since deleted
    orphan.mkdir()
    (orphan / prepared.STAMP).write_text(json.dumps({"state": "equal", "graph": str(tmp_path / "gone.onnx")}))
    making = cache / prepared.CACHE_KIND / ("1" * 32)  # no stamp, young: maybe another process's, left
    making.mkdir()
    dead = cache / prepared.CACHE_KIND / ("2" * 32)  # no stamp, untouched for over an hour: a killed process's
    dead.mkdir()
    os.utime(dead, (0, 0))
    v1 = cache / prepared.CACHE_KIND / ("3" * 32)  # made by PREPARE_VERSION 1 (no files in its stamp) for this graph
    v1.mkdir()
    (v1 / prepared.STAMP).write_text(json.dumps({"state": "equal", "graph": str(folder / "llm_step.onnx")}))
    step = folder / "llm_step.onnx"
    shutil.copy(step, tmp_path / "step.onnx")
    step.unlink()
    shutil.move(tmp_path / "step.onnx", step)  # the same bytes, another file: a new entry
    greedy(folder)
    left = sorted(p.name for p in (cache / prepared.CACHE_KIND).iterdir())
    assert not old.exists() and not orphan.exists() and not dead.exists() and not v1.exists() and making.exists()
    assert len(left) == 2
