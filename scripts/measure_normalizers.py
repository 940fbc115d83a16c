"""Measure a text normalizer on the case tables in tests/data/text/normalize_{en,zh}.tsv.

    python scripts/measure_normalizers.py --engine higgs                  # both tables, higgs_onnx.text.normalize
    /tmp/wetext/bin/python scripts/measure_normalizers.py --engine wetext --lang zh --show-misses

Table format: a header line `category<TAB>input<TAB>expected`, one case a line; `expected` holds one or more
readings separated by ` || `. A case is a hit when the engine's output equals one of the readings once both are
compared loosely: Unicode NFKC, case-folded, hyphens and dashes read as spaces, every character that is not a
letter, digit or whitespace removed, whitespace collapsed, and whitespace next to a CJK character dropped (Chinese
has no word spaces, so "www 点 baidu" and "www点baidu" read the same).

Second figure, "no digits left": of the cases whose readings contain no ASCII digit, how many outputs contain none
either (after NFKC, so a full-width digit left over counts as a digit) -- a rough "did it verbalize everything".

Engines:
  wetext  WeTextProcessing (`pip install WeTextProcessing`, imports `tn`); it loads the .fst grammars shipped in the
          wheel (cache_dir = the package folder, overwrite_cache=False) and never rebuilds them.
  higgs   `from higgs_onnx.text.normalize import normalize`, called as `normalize(text, language)`.

Standard library only, besides the engine under test.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLES = ROOT / "tests" / "data" / "text"
LANGS = ("en", "zh")

_DASHES = re.compile(r"[-\u2010\u2011\u2012\u2013\u2014\u2015\u2212\uff0d]")
_CJK = r"\u2e80-\u2fff\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_SPACE_NEAR_CJK = re.compile(rf"\s+(?=[{_CJK}])|(?<=[{_CJK}])\s+")
_ASCII_DIGIT = re.compile(r"[0-9]")


def canon(text: str) -> str:
    """The loose form two readings are compared in."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = _DASHES.sub(" ", text)
    text = "".join(ch for ch in text if ch.isalnum() or ch.isspace())
    text = " ".join(text.split())
    return _SPACE_NEAR_CJK.sub("", text)


def has_digit(text: str) -> bool:
    return bool(_ASCII_DIGIT.search(unicodedata.normalize("NFKC", text)))


def load_table(path: Path) -> list[tuple[str, str, list[str]]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].split("\t") != ["category", "input", "expected"]:
        sys.exit(f"{path}: the first line must be 'category<TAB>input<TAB>expected'")
    cases = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            sys.exit(f"{path}:{n}: expected 3 tab-separated fields, got {len(parts)}")
        cat, inp, exp = parts
        cases.append((cat, inp, [e.strip() for e in exp.split(" || ")]))
    return cases


# --- engines: each returns (callable text -> output, {timing name: seconds}) -----------------------------------

def engine_wetext(lang: str):
    timings = {}
    t0 = time.perf_counter()
    try:
        if lang == "en":
            from tn.english.normalizer import Normalizer
        else:
            from tn.chinese.normalizer import Normalizer
    except ImportError as e:
        sys.exit(f"engine wetext: cannot import WeTextProcessing ({e}). Install it in a scratch venv, e.g.\n"
                 "  python3 -m venv /tmp/wetext && /tmp/wetext/bin/pip install WeTextProcessing==1.2.0\n"
                 "and run this script with /tmp/wetext/bin/python.")
    timings["import"] = time.perf_counter() - t0
    import logging

    logging.getLogger("wetext").setLevel(logging.WARNING)  # its "found existing fst" lines
    import tn

    pkg = Path(tn.__file__).parent
    prefix = f"{lang}_tn"
    missing = [p.name for p in (pkg / f"{prefix}_tagger.fst", pkg / f"{prefix}_verbalizer.fst") if not p.exists()]
    if missing:
        print(f"warning: {', '.join(missing)} not in {pkg}: WeTextProcessing will build its grammars now "
              "(minutes) and write them there", file=sys.stderr)
    t0 = time.perf_counter()
    norm = Normalizer(overwrite_cache=False)  # cache_dir None = the package folder holding the prebuilt .fst files
    timings["load grammars"] = time.perf_counter() - t0
    return norm.normalize, timings


def engine_higgs(lang: str):
    timings = {}
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    try:
        from higgs_onnx.text.normalize import normalize
    except ModuleNotFoundError as e:
        if e.name in ("higgs_onnx", "higgs_onnx.text", "higgs_onnx.text.normalize"):
            sys.exit(f"engine higgs: the module higgs_onnx.text.normalize is missing ({e}); it must define "
                     "normalize(text, language). Run from a checkout that has it.")
        raise
    except ImportError as e:
        sys.exit(f"engine higgs: higgs_onnx.text.normalize has no usable `normalize` ({e}).")
    timings["import"] = time.perf_counter() - t0
    return (lambda text: normalize(text, lang)), timings


ENGINES = {"wetext": engine_wetext, "higgs": engine_higgs}


# --- scoring -----------------------------------------------------------------------------------------------------

def measure(engine: str, lang: str, table: Path, show_misses: bool) -> tuple[int, int]:
    cases = load_table(table)
    fn, timings = ENGINES[engine](lang)
    per_cat: dict[str, list[int]] = {}  # category -> [cases, hits, no-digit eligible, no-digit ok]
    misses = []
    run_times = []
    errors = []
    for i, (cat, inp, expected) in enumerate(cases):
        t0 = time.perf_counter()
        try:
            out = fn(inp)
            if not isinstance(out, str):
                out = f"<not a str: {type(out).__name__}>"
        except ImportError as e:  # a missing dependency is the environment's fault, not a miss
            sys.exit(f"engine {engine}: a call raised {type(e).__name__}: {e} -- install what it needs and rerun")
        except Exception as e:  # one failing case must not stop the measurement
            out = f"<error: {type(e).__name__}: {e}>"
            errors.append(f"[{cat}] {inp}: {type(e).__name__}: {e}")
        dt = time.perf_counter() - t0
        if i == 0:
            timings["first call"] = dt
        else:
            run_times.append(dt)
        row = per_cat.setdefault(cat, [0, 0, 0, 0])
        row[0] += 1
        hit = canon(out) in {canon(e) for e in expected}
        row[1] += hit
        if not any(has_digit(e) for e in expected):
            row[2] += 1
            row[3] += not has_digit(out)
        if not hit:
            misses.append((cat, inp, out, expected[0]))
    if run_times:
        run_times.sort()
        timings["median call"] = run_times[len(run_times) // 2]

    total = [sum(r[k] for r in per_cat.values()) for k in range(4)]
    print(f"\n== engine {engine}, lang {lang}: {table.relative_to(ROOT) if table.is_relative_to(ROOT) else table}")
    print("   " + ", ".join(f"{k} {v * 1000:.2f} ms" if v < 1 else f"{k} {v:.2f} s" for k, v in timings.items()))
    width = max(len(c) for c in [*per_cat, "category"])
    print(f"   {'category':<{width}}  {'hits':>9}  {'no digits left':>14}")
    for cat, (n, h, nd_n, nd_ok) in per_cat.items():
        nd = f"{nd_ok}/{nd_n}" if nd_n else "-"
        print(f"   {cat:<{width}}  {h:>4}/{n:<4}  {nd:>14}")
    n, h, nd_n, nd_ok = total
    print(f"   {'TOTAL':<{width}}  {h:>4}/{n:<4}  {f'{nd_ok}/{nd_n}':>14}   ({100 * h / n:.1f}% hits)")
    if errors:
        print(f"   {len(errors)} case(s) raised an exception (counted as misses); first: {errors[0]}")
    if show_misses and misses:
        print(f"\n   misses ({len(misses)}):")
        for cat, inp, out, exp in misses:
            print(f"   [{cat}] {inp}\n      got:      {out}\n      expected: {exp}")
    return h, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, choices=sorted(ENGINES))
    ap.add_argument("--lang", choices=LANGS, help="one table (default: both)")
    ap.add_argument("--table", type=Path, help="another table file (needs --lang)")
    ap.add_argument("--show-misses", action="store_true", help="print every case that is not a hit")
    args = ap.parse_args(argv)
    if args.table and not args.lang:
        ap.error("--table needs --lang")
    for lang in [args.lang] if args.lang else LANGS:
        table = args.table or TABLES / f"normalize_{lang}.tsv"
        if not table.exists():
            sys.exit(f"no table at {table}")
        measure(args.engine, lang, table, args.show_misses)
    return 0


if __name__ == "__main__":
    sys.exit(main())
