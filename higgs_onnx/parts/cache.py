"""Finished part builds, kept between runs: `onnx/.build/parts/<part>-<stamp>/` with the part's files and its
`stamp.json` (the manifest entry of the build, without file hashes).

    cache = PartCache(root, opts)             # root: onnx/.build/parts (or --part-cache); opts: ExportOptions
    stamp = cache.stamp("audio_heads", digest)
    entry = cache.get("audio_heads", stamp)   # the finished build's entry, or None (missing, stale, --force ...)
    tmp = cache.scratch("audio_heads", stamp) # a fresh folder to build into
    entry = cache.put("audio_heads", stamp, entry)   # stamp.json written, the folder swapped in whole

A stamp is the hash of everything a part's files depend on: its precision, the block size, the accuracy level, the
checkpoint's digest and the part's `BUILD_VERSION`; the device and decoder graph only for a part whose graph
depends on them (`PartFacts.device_specific`), so `cpu_int4` and `cuda_int4` share every other part. A build is
swapped in only once it is complete (`put`), so a killed build leaves no folder that looks finished.

The cache is `<output>/.build/parts` unless `optimize.py --part-cache DIR` (or `$HIGGS_PART_CACHE`) names another
folder: exports under several output roots then share their finished parts (the test suite shares one per session).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from . import device_specific, module
from .int4_layout import POLICY as LAYOUT_POLICY

STAMP = "stamp.json"


class PartCache:
    def __init__(self, root: Path, opts):
        self.root, self.opts = Path(root), opts

    def stamp(self, part: str, checkpoint_digest: str) -> str:
        o = self.opts
        key = {"part": part, "precision": o.precisions[part], "block": o.block, "accuracy": o.accuracy,
               "checkpoint": checkpoint_digest, "version": module(part).BUILD_VERSION}
        if device_specific(part):
            key["device"], key["attention"] = o.device, o.decoder_attention
        if part == "llm_decoder" and o.gate_layout:  # its block chosen by the int4 layout's gate, under its policy
            key["block"] = f"gated-{LAYOUT_POLICY}"
        if part == "llm_decoder" and o.route:  # its files then hold the int8 GEMM route's weights too (s8: as before)
            key["route"] = "int8" if o.route_form == "s8" else f"int8-{o.route_form}"
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def folder(self, part: str, stamp: str) -> Path:
        return self.root / f"{part}-{stamp[:16]}"

    def get(self, part: str, stamp: str) -> dict | None:
        """The entry of a finished build of this part (with `skipped`), unless it must be rebuilt: asked for
        (`--force`, `--components`), never finished, another stamp, or a file gone."""
        o, done = self.opts, self.folder(part, stamp)
        if o.force or part in o.components or not (done / STAMP).is_file():
            return None
        entry = json.loads((done / STAMP).read_text())
        if entry.get("stamp") != stamp or not all((done / n).is_file() for n in entry["files"]):
            return None
        return {**entry, "skipped": True}

    def scratch(self, part: str, stamp: str) -> Path:
        """An empty folder beside the finished one to build into (whatever a killed build left there is gone)."""
        tmp = self.folder(part, stamp).with_name(self.folder(part, stamp).name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        return tmp

    def put(self, part: str, stamp: str, entry: dict) -> dict:
        """Stamp the scratch folder's build with `entry` and swap it in for any older one; returns the entry."""
        done = self.folder(part, stamp)
        tmp = done.with_name(done.name + ".tmp")
        (tmp / STAMP).write_text(json.dumps(entry, indent=2))
        shutil.rmtree(done, ignore_errors=True)
        os.replace(tmp, done)
        return {**entry, "skipped": False}
