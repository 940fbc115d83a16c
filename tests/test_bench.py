"""The benchmark runs end to end on the tiny preset (figures printed and written; no timing asserts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(*args, **kw):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "CI": "1"}, **kw)


@pytest.mark.slow  # builds and benchmarks the tiny preset
def test_bench_tiny_smoke(tmp_path):
    r = bench("--preset", "tiny", "--frames", 16, "--steps", 10, "--work", tmp_path, "--json", tmp_path / "b.json",
              timeout=900)
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
def test_bench_batch_gain_tiny(tmp_path):
    r = bench("--preset", "tiny", "--batch", 2, 4, "--frames", 24, "--repeats", 2, "--work", tmp_path, "--json",
              tmp_path / "b.json", timeout=600)
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
