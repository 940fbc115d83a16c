"""The benchmark runs end to end on the tiny preset (figures printed and written; no timing asserts)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(*args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, **kw)


@pytest.mark.slow  # builds and benchmarks the tiny preset
def test_bench_tiny_smoke(tiny_ckpt, tmp_path):
    # the preset's checkpoint where bench.py keeps it: the session's, copied with its times (the part cache's stamp
    # names the checkpoint by size and mtime), so the export's parts come from the session's part cache
    shutil.copytree(tiny_ckpt, tmp_path / "tiny" / "synthetic_tiny", copy_function=shutil.copy2)
    # the memory check's long line at 20 s of audio (default 60): the same figures, a third of the rows
    r = bench("--preset", "tiny", "--frames", 16, "--steps", 10, "--long-seconds", 20, "--work", tmp_path,
              "--json", tmp_path / "b.json", timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    b = json.loads((tmp_path / "b.json").read_text())
    for key in ("bandwidth_gbs", "floor_ms", "decoder_step_ms", "prefill_zero_shot_ms", "prefill_clone_ms",
                "codec_decode_ms_per_audio_s", "codec_encode_ms_per_audio_s", "int4_decoder_export_s",
                "int4_decoder_export_peak_rss_mb", "speedup_vs_torch", "step_x_floor"):
        assert b[key] > 0, key
    assert b["bandwidth_probe"].startswith("NumPy float32 max") and b["bandwidth_probe"] in r.stdout
    g = b["generation"]
    assert g["rows"] > 0 and g["peak_rss_mb"] > 0 and g["host_overhead_ms_per_row"] >= 0
    assert g["first_frame_cached_voice_s"] > 0 and g["first_frame_new_voice_s"] > 0
    assert "decoder step (median)" in r.stdout and "x floor" in r.stdout
    for key in ("first", "second"):  # the export ready to prefill, in two fresh processes, its own row
        ld = b["load"][key]
        assert 0 < ld["opened_s"] < ld["ready_s"] < ld["process_s"] and ld["sessions_s"] > 0, ld
        assert ld["decoder"] == "llm_step" and f"ready to prefill, {key} load" in r.stdout
    c = b["continuity"]  # the streaming section's playback figures at 1 and 8 concurrent streams
    assert [x["streams"] for x in c["runs"]] == [1, 8] and "playback, 8 streams" in r.stdout
    for x in c["runs"]:
        assert len(x["events"]) == x["streams"] and x["figures"]["windows"] == x["streams"] * 50  # 5 s each
        assert x["figures"]["audio_s"] == pytest.approx(5.0 * x["streams"]) and 0 <= x["figures"]["on_time"] <= 1


def test_bench_refuses_negative_threads(tmp_path):  # fast: refused before anything is built
    r = bench("--preset", "tiny", "--threads", -1, "--work", tmp_path, timeout=120)
    assert r.returncode == 2 and "threads must be >= 0" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was built


@pytest.mark.slow
def test_bench_batch_gain_tiny(builds, tmp_path):
    """On the session's int4 export (the smoke test above covers building the preset's)."""
    r = bench("--model-path", builds["int4"], "--batch", 2, 4, "--frames", 24, "--repeats", 2, "--work", tmp_path,
              "--json", tmp_path / "b.json", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    b = json.loads((tmp_path / "b.json").read_text())
    assert [x["batch"] for x in b["batches"]] == [1, 2, 4]  # B = 1, the denominator, is always measured
    assert b["gain"]["1"] == 1.0 and set(b["gain"]) == {"1", "2", "4"} and b["repeats"] == 2
    for x in b["batches"]:
        assert x["step_ms"] >= x["decoder_ms"] > 0 and x["rows_per_s"] > 0 and x["rows_per_request"] == 24
        assert x["gain"] == x["rows_per_s"] / b["batches"][0]["rows_per_s"] and len(x["rounds_rows_per_s"]) == 2
    assert b["peak_rss_mb"] > 0 and isinstance(b["cpu"]["flags"], list)
    assert "batched decoding through the scheduler" in r.stdout and "G(B)" in r.stdout and "RTF/request" in r.stdout
    assert f"CPU: {b['cpu']['model']}" in r.stdout


BAD_RUNS = [  # (arguments, the one line's start); the numbers were used or failed deep in a run (a traceback)
    (["--continuity", "--streams", "1", "0"], "--streams must be >= 1, got 1 0"),
    (["--continuity", "--stream-seconds", "0"], "--stream-seconds must be a number of seconds > 0, got 0.0"),
    (["--continuity", "--stream-seconds", "nan"], "--stream-seconds must be a number of seconds > 0, got nan"),
    (["--continuity", "--chunk-frames", "0"], "--chunk-frames must be >= 1, got 0"),
    (["--routes", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--batch", "0", "4"], "--batch must be >= 1, got 0 4"),
    (["--frames", "-1"], "--frames must be >= 1, got -1"),
    (["--long-seconds", "inf"], "--long-seconds must be a number of seconds > 0, got inf"),
    (["--load", "--routes"], "--load and --routes are runs of their own: one at a time"),
    (["--batch", "2", "--continuity"], "--continuity and --batch are runs of their own"),
    (["--load", "--json", "/no/such/b.json"], "--json /no/such/b.json: folder /no/such does not exist"),
]


def test_bench_refuses_bad_numbers_and_modes_before_any_work(tmp_path):  # fast: one process, nothing built
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import bench\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    try:\n        bench.main(args)\n"
            "    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)")
    runs = [[*args, "--work", str(tmp_path)] for args, _ in BAD_RUNS]
    r = subprocess.run([sys.executable, "-c", code, json.dumps(runs)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    lines = r.stderr.splitlines()
    assert len(lines) == 2 * len(BAD_RUNS), r.stderr
    for (args, message), line, ended in zip(BAD_RUNS, lines[::2], lines[1::2], strict=True):
        assert line.startswith(f"error: {message}") and ended == "exit 2", (args, line, ended)
    assert not any(tmp_path.iterdir())


def test_bench_names_the_cpu_flags():  # fast: reads /proc/cpuinfo only
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench import CPU_FLAGS, cpu_info, cpu_line
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cpu = cpu_info()
    known = set(CPU_FLAGS)
    assert all(f in known or f.startswith("amx_") for f in cpu["flags"])
    info = Path("/proc/cpuinfo")
    line = next((ln for ln in info.read_text().splitlines() if ln.startswith("flags")), "") if info.is_file() else ""
    flags = line.split(":", 1)[-1].split()
    assert ("avx2" in cpu["flags"]) == ("avx2" in flags)
    assert cpu_line(cpu).startswith(cpu["model"])


def test_bench_refuses_a_model_path_without_a_manifest(tmp_path):  # fast: refused before anything is loaded
    r = bench("--model-path", tmp_path, "--batch", 1, "--work", tmp_path / "w", timeout=120)
    assert r.returncode == 2 and "no manifest.json there" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_bench_context_curve_and_matmul_table_tiny(builds, tmp_path):
    """`--context-curve` on the int8-cache export: both caches, every context that fits the model, two runs each,
    a quarter of the bytes per position; `--matmul`: every block that divides K, both accuracy levels, M = 1..16."""
    r = bench("--model-path", builds["int4"], "--context-curve", "--steps", 3, "--frames", 12, "--json",
              tmp_path / "c.json", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    c = json.loads((tmp_path / "c.json").read_text())
    assert set(c["curves"]) == {"int8", "fp32"} and all(len(runs) == 2 for runs in c["curves"].values())
    assert list(c["curves"]["int8"][0]["step_ms"]) == ["128", "512", "1024", "2048"]  # 4096 > the tiny context
    assert c["curves"]["fp32"][0]["kv_bytes_per_position"] == 4 * c["curves"]["int8"][0]["kv_bytes_per_position"]
    assert all(ms > 0 for runs in c["curves"].values() for run in runs for ms in run["step_ms"].values())
    assert "step at 2048 / at 128" in r.stdout and "host" in r.stdout and "avx" in r.stdout
    r = bench("--model-path", builds["int4"], "--matmul", "--json", tmp_path / "m.json", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())["matmul"]
    assert [(x["block"], x["accuracy_level"]) for x in m] == [(32, 4), (32, 0)]  # 128 does not divide K = 64
    assert all(list(x["ms"]) == ["1", "2", "4", "8", "16"] and min(x["ms"].values()) > 0 for x in m)
    assert "one int4 MatMulNBits 64 x" in r.stdout


def _continuity():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from continuity import continuity
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return continuity


SR = 24000  # samples a second: a 100 ms window is 2,400 samples


def test_continuity_of_hand_made_timelines():  # fast: the figures of known chunk timelines
    continuity = _continuity()
    # 1.0 s of audio, the first chunk (0.3 s) at 1.0 s: windows are due at 1.0, 1.1, ... 1.9. The second chunk
    # (0.5 s, windows 3-7, due from 1.3) comes early; the third (0.2 s, windows 8-9, due 1.8 and 1.9) at 2.05 s:
    # 250 and 150 ms late. A player that waits pauses once, 250 ms (the third chunk was due at 1.8 s, when the
    # first two had played): its longest pause is over 100 ms (C100 fails).
    late = [(1.0, 7200), (1.2, 12000), (2.05, 4800)]
    g = continuity([late], SR)
    assert (g["windows"], g["late_windows"], g["on_time"]) == (10, 2, 0.8)
    assert g["underrun_max_ms"] == pytest.approx(250) and g["underrun_p95_ms"] == pytest.approx(150 + 0.95 * 100)
    assert (g["stalls"], g["longest_stall_ms"], g["c100"]) == (1, pytest.approx(250), 0.0)
    assert (g["first_audio_s"], g["audio_s"]) == (1.0, pytest.approx(1.0))
    # audio always ahead of the player: every window on time, no underrun, no stall
    ahead = [(0.5, 7200), (0.6, 24000), (1.5, 24000)]
    h = continuity([ahead], SR)
    assert (h["windows"], h["on_time"], h["underrun_p95_ms"], h["underrun_max_ms"], h["stalls"]) == (23, 1.0, 0, 0, 0)
    assert h["c100"] == 1.0
    # both streams pooled: 33 windows, 2 late; first audio p50 / max over the streams; each stream's own figures
    both = continuity([late, ahead], SR)
    assert both["on_time"] == pytest.approx(31 / 33) and both["late_windows"] == 2
    assert (both["first_audio_s"], both["first_audio_max_s"]) == (0.75, 1.0)
    assert [s["on_time"] for s in both["streams"]] == [0.8, 1.0] and both["audio_s"] == pytest.approx(3.3)
    assert both["c100"] == 0.5 and both["stalls"] == 1


def test_continuity_window_edges_and_stalls():  # fast
    continuity = _continuity()
    # a window is on time only when all of it is there: 0.25 s then 0.25 s at 0.21 s; window 2 (0.2-0.3 s of
    # playback, due at 0.2 s) waits for the second chunk: 10 ms late; the last window is half a window (0.05 s).
    # A player that plays each sample as soon as it can needs the second chunk only at 0.25 s: no pause.
    g = continuity([[(0.0, 6000), (0.21, 6000)]], SR)
    assert (g["windows"], g["late_windows"]) == (5, 1) and g["underrun_max_ms"] == pytest.approx(10)
    assert (g["stalls"], g["c100"]) == (0, 1.0)
    assert g["audio_s"] == pytest.approx(0.5)
    # a player that waits goes on later: after a 300 ms pause at 0.1 s of playback (resumed at 0.4 s), the next
    # chunk is due at 0.5 s and comes at 0.75 s: a second pause of 250 ms (the fixed clock counts it 550 ms late)
    s = continuity([[(0.0, 2400), (0.4, 2400), (0.75, 2400)]], SR)
    assert s["stalls"] == 2 and s["longest_stall_ms"] == pytest.approx(300) and s["c100"] == 0.0
    assert s["underrun_max_ms"] == pytest.approx(550) and s["on_time"] == pytest.approx(1 / 3)
    # empty chunks are not audio; a stream with none is refused
    assert continuity([[(0.1, 0), (0.2, 2400)]], SR)["first_audio_s"] == 0.2
    with pytest.raises(ValueError, match="no audio"):
        continuity([[(0.1, 0)]], SR)
