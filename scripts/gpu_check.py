"""The GPU check: build `cuda_int4` and `cuda_fp16`, run the parity report on CUDA and print one speed table.

For a user with an NVIDIA GPU and `onnxruntime-gpu` (same version as requirements.txt's onnxruntime, installed in
place of it). This project's machines have no GPU: the cuda rows of the README's device matrix are "built, not run
here" until someone runs this and sends the output.

    python scripts/gpu_check.py --synthetic tiny                 # minutes: the whole path on a tiny model
    python scripts/gpu_check.py --synthetic 4b                   # the real geometry (random weights): speed table
    python scripts/gpu_check.py --model-dir bosonai/higgs-tts-3-4b   # the real model
    python scripts/gpu_check.py ... --precisions int4 --report gpu_check.md

Per precision: optimize (the decoder is ModelBuilder's cuda graph; the other parts are shared with cpu builds),
then `eval.py`'s parity report on the cuda provider (every part and generation against the PyTorch reference;
exit status 1 if a gate fails), then the speed figures with the KV cache resident on the GPU: decoder prefill,
the median decode step at a context of 128, and one generation (rows/s, real-time factor), beside the same
figures of the cpu_int4 export in the same run for the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from higgs_onnx import providers  # noqa: E402
from higgs_onnx.cli import add_log_level, run_main  # noqa: E402

GPU = providers.get("cuda")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="checkpoint folder or Hub repo id")
    src.add_argument("--synthetic", choices=["tiny", "4b"], help="a synthetic checkpoint (built if missing)")
    ap.add_argument("--precisions", nargs="+", choices=GPU.precisions["gqa"], default=["int4", "fp16"])
    ap.add_argument("--output", type=Path, default=ROOT / "onnx", help="export root (default %(default)s)")
    ap.add_argument("--steps", type=int, default=50, help="decode steps for the step median")
    ap.add_argument("--rows", type=int, default=64, help="rows of the timed generation")
    ap.add_argument("--no-cpu", action="store_true", help="skip the cpu_int4 comparison row")
    ap.add_argument("--report", type=Path, help="also write the results as JSON here")
    add_log_level(ap)
    return ap


def require_gpu_provider() -> None:
    import onnxruntime as ort

    if GPU.ort_name not in ort.get_available_providers():
        raise RuntimeError(f"{GPU.ort_name} is not available in this onnxruntime "
                           f"({', '.join(ort.get_available_providers())}): install {GPU.install}")


def speed(folder: Path, provider: str, steps: int, rows: int) -> dict:
    from benchmarks.bench import decoder_figures
    from higgs_onnx.generation.options import GenerationOptions
    from higgs_onnx.runtime.model import HiggsTTS

    tts = HiggsTTS(folder, provider=provider, verify=False)
    tts.generate("Warm up.", max_rows=8)
    figs = decoder_figures(tts, context=128, steps=steps)
    t0 = time.perf_counter()
    speech = tts.generate("The quick brown fox jumps over the lazy dog.",
                          options=GenerationOptions(temperature=0, max_rows=rows, ignore_eoc=True))
    wall = time.perf_counter() - t0
    return {**figs, "rows": speech.rows.shape[0], "rows_per_s": speech.rows.shape[0] / wall,
            "rtf": wall / max(speech.waveform.size / speech.sample_rate, 1e-9),
            "kv_memory": tts.kv_memory}


def run(args: argparse.Namespace) -> int:
    from higgs_onnx.checkpoint import DEFAULT_REPO
    from higgs_onnx.evaluation import Outputs, evaluate
    from higgs_onnx.export import Exporter, ExportOptions

    require_gpu_provider()
    results, failed = {}, []
    targets = [(GPU.name, p) for p in args.precisions] + ([] if args.no_cpu else [(providers.BUILD_PROVIDER.name,
                                                                                     "int4")])
    for device, precision in targets:
        opts = ExportOptions(device=device, precision=precision)
        print(f"== {opts.name}: build", flush=True)
        folder = Exporter(args.model_dir or DEFAULT_REPO, args.output, opts, synthetic=args.synthetic).run()
        entry = {}
        if device == GPU.name:
            print(f"== {opts.name}: parity report on {device}", flush=True)
            md = args.output / f"{opts.name}_gpu_report.md"
            report, _ = evaluate(folder, outputs=Outputs.resolve(None, md, None, draw=False), provider=device)
            entry["parity"] = "PASS" if not report.failures else f"FAIL: {report.failures[0]}"
            entry["report"] = str(md)
            if report.failures:
                failed.append(opts.name)
        print(f"== {opts.name}: speed", flush=True)
        entry.update(speed(folder, device, args.steps, args.rows))
        results[opts.name] = entry
    print(f"\n{'export':<12}{'parity':<8}{'KV on':<7}{'prefill ms':>11}{'step ms':>9}{'rows/s':>8}{'RTF':>7}")
    for name, e in results.items():
        print(f"{name:<12}{e.get('parity', '-')[:6]:<8}{e['kv_memory']:<7}{e['prefill_zero_shot_ms']:>11.1f}"
              f"{e['decoder_step_ms']:>9.2f}{e['rows_per_s']:>8.1f}{e['rtf']:>7.2f}")
    if args.report:
        args.report.write_text(json.dumps(results, indent=2))
    if failed:
        print(f"FAILED parity: {', '.join(failed)} (see the reports above)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
