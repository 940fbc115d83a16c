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
