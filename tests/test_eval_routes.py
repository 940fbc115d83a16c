"""eval.py through every route the runtime offers, so that a device row cannot break without the suite noticing.

The routes: ONNX Runtime with the one-call step graph (the default), the parts apart (`--parts-apart`), the cache
through the host (`--kv-cache host`), the OpenVINO IR export with its cache as OpenVINO state and through the host,
and `--provider openvino` on a cpu export (fp32 cache: an int8 cache is refused by name). Each must report every
section with the same quantities and pass; the decoder sections used to feed `past_key_values.*` by name, which the
stateful OpenVINO decoder does not have (issue 32).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
eval_script = importlib.import_module("eval")  # the top-level eval.py

# (export, eval.py flags, the decoder part it runs, where its KV cache lives)
ROUTES = {
    "ort-step-graph": ("cpu_int4", [], "llm_step", "cpu"),
    "ort-parts-apart": ("cpu_int4", ["--parts-apart"], "llm_decoder", "cpu"),
    "ort-host-cache": ("cpu_int4", ["--kv-cache", "host"], "llm_step", "host"),
    "openvino-state": ("openvino_int4", ["--provider", "openvino"], "llm_decoder", "state"),
    "openvino-host-cache": ("openvino_int4", ["--provider", "openvino", "--kv-cache", "host"], "llm_decoder", "host"),
    "openvino-on-cpu-export": ("cpu_fp32", ["--provider", "openvino"], "llm_step", "state"),
}
# small but complete: one prompt, every section runs (one sampled run), generation cut at 48 rows; cut runs do not
# stop at EOC, so that gate is off here (make demo / make openvino-demo run the full defaults with every gate)
SMALL = ["--runs", "1", "--max-rows", "48", "--threshold", "eoc_rate=none", "--no-plots",
         "--recordings", str(ROOT / "tests" / "data" / "ref_de_22k_stereo.wav")]


@pytest.fixture(scope="module")
def exports(builds, openvino_build):
    return {"cpu_int4": builds["int4"], "cpu_fp32": builds["fp32"], "openvino_int4": openvino_build}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("routes") / "prompts.txt"
    path.write_text("<|emotion:elation|>Hello there, how are you today?\n")
    return path


@pytest.fixture(scope="module")
def reports(exports, prompts, tmp_path_factory):
    """route -> (exit code, the JSON report) of eval.py run in this process, made on first use (so each test's time
    is its own route's, not all six at once)."""
    folder, made = tmp_path_factory.mktemp("route-reports"), {}

    class Reports(dict):
        def __missing__(self, route):
            export, flags, _, _ = ROUTES[route]
            path = folder / f"{route}.json"
            code = eval_script.main(["--model-path", str(exports[export]), "--prompts", str(prompts), *SMALL,
                                     "--json", str(path), *flags])
            self[route] = (code, json.loads(path.read_text()))
            return self[route]

    return Reports(made)


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
    """The ORT routes of cpu_int4 run the same weights and kernels: the decoder's hidden states and the greedy runs
    agree to rounding; the OpenVINO export's two cache routes too."""
    for a, b in (("ort-step-graph", "ort-parts-apart"), ("ort-step-graph", "ort-host-cache"),
                 ("openvino-state", "openvino-host-cache")):
        sa, sb = reports[a][1]["sections"], reports[b][1]["sections"]
        assert sa["decoder_steps"]["cosine"] == pytest.approx(sb["decoder_steps"]["cosine"], abs=1e-5), (a, b)
        assert sa["text_lm"]["onnx"] == sb["text_lm"]["onnx"], (a, b)


def test_openvino_on_an_int8_cache_export_is_refused_by_name(exports, capsys):
    code = eval_script.main(["--model-path", str(exports["cpu_int4"]), "--provider", "openvino", *SMALL])
    err = capsys.readouterr().err
    assert code != 0 and "int8 KV cache" in err and "--kv-cache fp32" in err and "Traceback" not in err
