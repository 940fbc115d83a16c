"""The make targets the README names, run as a user runs them (the Makefile's own recipes), into a temporary folder;
and eval.py through every route the runtime offers, so that a device row cannot break without the suite noticing.

`make demo` and `make openvino-demo` build -> speak -> report; their exports go to the session's export root, where
the suite's tiny checkpoint and part cache already are (the targets' `optimize.py --synthetic tiny --output OUT`
finds both), so what they add is their own steps: the CLI build, the wavs and eval.py's report through the runtime
they name. `make -o .venv/.installed` keeps make from installing anything (the suite runs inside that install);
`BIN` is this interpreter's folder.

The routes: ONNX Runtime with the one-call step graph (the default: `make demo`'s report), the parts apart
(`--parts-apart`), the cache through the host (`--kv-cache host`), the OpenVINO IR export with its cache as OpenVINO
state (`make openvino-demo`'s report) and through the host, and `--provider openvino` on a cpu export (fp32 cache:
an int8 cache is refused by name). Each must report every section with the same quantities and pass; the decoder
sections used to feed `past_key_values.*` by name, which the stateful OpenVINO decoder does not have (issue 32).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from higgs_onnx.evaluation.options import DEFAULT_PROMPTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
eval_script = importlib.import_module("eval")  # the top-level eval.py


def make(target: str, out: Path, wavs: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "1"}
    return subprocess.run(["make", "-C", str(ROOT), "-o", ".venv/.installed", target,
                           f"BIN={Path(sys.executable).parent}", f"OUT={out}", f"WAVS={wavs}", *extra],
                          capture_output=True, text=True, timeout=timeout, env=env)


def check_report(path: Path, route: str) -> str:
    text = path.read_text()
    assert re.search(r"Result: \*\*PASS\*\* \((\d+) of \1 checks passed\)", text), text[:2000]
    assert "**Broke**" not in text and "## Failures" not in text
    assert route in text
    return text


def check_wav(path: Path) -> None:
    audio, rate = sf.read(path)
    assert rate == 24000 and len(audio) > 2400 and np.isfinite(audio).all() and np.abs(audio).max() > 0


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-wavs")


@pytest.fixture(scope="module")
def demo(builds, out_root, wavs, route_crossover):
    """`make demo` into the session's export root, with the route crossover `builds` gave its int4 export: the
    target finds it up to date (a measured crossover would rebuild it, under the tests of this worker that use it)."""
    given = " ".join("none" if v is None else str(v) for v in route_crossover)
    return make("demo", out_root, wavs, f"OPTIMIZE_ARGS=--route-crossover {given}")


@pytest.fixture(scope="module")
def openvino_demo(openvino_build, out_root, wavs):
    return make("openvino-demo", out_root, wavs)


def test_make_demo(demo, out_root, wavs):
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "up to date" in demo.stdout  # the session's cpu_int4, as built: nothing rebuilt under the other tests
    for name in ("demo.wav", "demo_clone.wav", "demo_stream.wav"):
        check_wav(wavs / name)
    check_report(out_root / "cpu_int4_report.md", "Route: the step graph")
    assert (out_root / "cpu_int4_report_plots").is_dir() and any((out_root / "cpu_int4_report_plots").glob("*.png"))
    assert json.loads((out_root / "cpu_int4_report.json").read_text())["passed"]


def test_make_openvino_demo(openvino_demo, out_root, wavs):
    """Issue 32: the OpenVINO decoder keeps its cache as state, and eval's decoder sections used to feed the cache
    by port names it does not have (`Result: FAIL (10 of 12 checks passed)`)."""
    r = openvino_demo
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "up to date" in r.stdout  # the session's openvino_int4: the target's build step found it
    check_wav(wavs / "demo_openvino.wav")
    text = check_report(out_root / "openvino_int4_report.md", "the KV cache is OpenVINO state")
    assert "OpenVINO:CPU" in text


def test_make_lint_and_clean(tmp_path):
    """`make lint` passes on the checkout; `make clean` removes the exports, the hand-made checkpoints and the demo
    wavs it is pointed at, and nothing else."""
    r = subprocess.run(["make", "-C", str(ROOT), "-o", ".venv/.installed", "lint",
                        f"BIN={Path(sys.executable).parent}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out, models = tmp_path / "onnx", tmp_path / "models"
    for d in (out / "cpu_int4", models / "tiny"):
        d.mkdir(parents=True)
        (d / "f").write_text("x")
    for name in ("demo.wav", "demo_clone.wav", "keep.wav"):
        (tmp_path / name).write_text("x")
    r = make("clean", out, tmp_path, f"MODELS={models}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.wav"]


def test_the_readme_names_only_targets_that_exist():
    """Every `make X` the README and docs/ name is a target of the Makefile, and each of those runs in the suite:
    demo, openvino-demo, lint, clean here, test and test-fast are what the suite is, venv and agents-venv (Pipecat's,
    for tests/test_agents.py) are their prerequisites, coverage runs the suite under coverage."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        named |= set(re.findall(r"`make ([a-z][a-z-]*)", doc.read_text()))
    assert named and named <= targets, named - targets
    assert named <= {"demo", "openvino-demo", "lint", "clean", "test", "test-fast", "venv", "agents-venv",
                     "coverage"}, named


# (export, eval.py flags, the decoder part it runs, where its KV cache lives)
ROUTES = {
    "ort-step-graph": ("cpu_int4", None, "llm_step", "cpu"),  # None: the make target's report
    "ort-int4-only": ("cpu_int4", ["--route", "off"], "llm_step", "cpu"),  # without the int8 prefill route
    "ort-parts-apart": ("cpu_int4", ["--parts-apart"], "llm_decoder", "cpu"),
    "ort-host-cache": ("cpu_int4", ["--kv-cache", "host"], "llm_step", "host"),
    "openvino-state": ("openvino_int4", None, "llm_decoder", "state"),
    "openvino-host-cache": ("openvino_int4", ["--provider", "openvino", "--kv-cache", "host"], "llm_decoder", "host"),
    "openvino-on-cpu-export": ("cpu_fp32", ["--provider", "openvino"], "llm_step", "state"),
}
# small but complete: every section runs (one sampled run a prompt), generation cut at 48 rows; cut runs do not stop
# at EOC, so that gate is off here (the make targets' reports run the full defaults with every gate). The prompts are
# the defaults' first and last: the decoder-steps section reads the first, the text LM the last, so those figures
# compare with the make targets' reports.
SMALL = ["--runs", "1", "--max-rows", "48", "--threshold", "eoc_rate=none", "--no-plots",
         "--recordings", str(ROOT / "tests" / "data" / "ref_de_22k_stereo.wav")]


@pytest.fixture(scope="module")
def exports(builds, openvino_build):
    return {"cpu_int4": builds["int4"], "cpu_fp32": builds["fp32"], "openvino_int4": openvino_build}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("routes") / "prompts.txt"
    path.write_text(f"{DEFAULT_PROMPTS[0]}\n{DEFAULT_PROMPTS[-1]}\n")
    return path


@pytest.fixture(scope="module")
def reports(exports, prompts, tmp_path_factory, demo, openvino_demo, out_root):
    """route -> (exit code, the JSON report): the make targets' reports for the default routes, else eval.py run in
    this process, made on first use (so each test's time is its own route's, not all at once)."""
    folder = tmp_path_factory.mktemp("route-reports")

    class Reports(dict):
        def __missing__(self, route):
            export, flags, _, _ = ROUTES[route]
            if flags is None:
                target = demo if export == "cpu_int4" else openvino_demo
                self[route] = (target.returncode, json.loads((out_root / f"{export}_report.json").read_text()))
                return self[route]
            path = folder / f"{route}.json"
            code = eval_script.main(["--model-path", str(exports[export]), "--prompts", str(prompts), *SMALL,
                                     "--json", str(path), *flags])
            self[route] = (code, json.loads(path.read_text()))
            return self[route]

    return Reports()


@pytest.mark.parametrize("route", ROUTES)
def test_every_section_runs_and_passes_on_the_route(reports, route):
    code, report = reports[route]
    _, _, decoder, cache = ROUTES[route]
    assert report["meta"]["route"]["decoder"] == decoder and report["meta"]["route"]["kv_cache"] == cache
    broken = {name: s["error"] for name, s in report["sections"].items() if "error" in s}
    assert not broken, broken
    assert report["passed"] and code == 0, [c for c in report["checks"] if not c["ok"]]
    steps = report["sections"]["decoder_steps"]
    assert len(steps["per_step"]) == 1 + 8 and all(0 < s["cosine"] <= 1 + 1e-6 for s in steps["per_step"])
    assert report["sections"]["text_lm"]["continuation_tokens"] == 16


def test_every_route_reports_the_same_quantities(reports):
    """The same sections with the same figures on every route of one export (skips aside: the int8 cache's section
    runs only where the export has one)."""
    def shape(report):
        return {name: sorted(k for k in s if not k.startswith("_")) for name, s in report["sections"].items()}

    by_export = {}
    for route, (export, *_) in ROUTES.items():  # every route's report (made by the parametrized test above)
        by_export.setdefault(export, []).append(shape(reports[route][1]))
    for export, shapes in by_export.items():
        assert all(s == shapes[0] for s in shapes), export
    assert "skipped" not in reports["ort-host-cache"][1]["sections"]["kv_cache"]  # the int8 cache, on the host route


def test_routes_of_one_export_agree(reports):
    """The ORT routes of cpu_int4 on the int4 graph run the same weights and kernels: the decoder's hidden states
    agree to rounding and the text LM's greedy tokens are equal; the OpenVINO export's two cache routes too. (The
    make target's report runs prefills on the int8 route: its own section compares the two, and its gate holds.)"""
    assert reports["ort-step-graph"][1]["meta"]["route"]["int8_route"] in (True, False)
    assert all(c["ok"] for c in reports["ort-step-graph"][1]["checks"] if c["section"] == "route")
    for a, b in (("ort-int4-only", "ort-parts-apart"), ("ort-int4-only", "ort-host-cache"),
                 ("openvino-state", "openvino-host-cache")):
        sa, sb = reports[a][1]["sections"], reports[b][1]["sections"]
        assert sa["decoder_steps"]["cosine"] == pytest.approx(sb["decoder_steps"]["cosine"], abs=1e-5), (a, b)
        assert sa["text_lm"]["onnx"] == sb["text_lm"]["onnx"], (a, b)


def test_openvino_on_an_int8_cache_export_is_refused_by_name(exports, capsys):
    code = eval_script.main(["--model-path", str(exports["cpu_int4"]), "--provider", "openvino", *SMALL])
    err = capsys.readouterr().err
    assert code != 0 and "int8 KV cache" in err and "--kv-cache fp32" in err and "Traceback" not in err
