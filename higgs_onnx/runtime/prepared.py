"""The decoder's graphs prepared once for fast loads: ONNX Runtime's optimized graph with its prepacked weights.

Making the int4 step graph's session re-packs every MatMulNBits weight for the CPU's kernels (on the 4b, 2.3 GB of
int4 weights: most of its 3.3-5.2 s load on a 2-vCPU AMD EPYC), and the int8 route's packs its 3.6 GB of int8 GEMM
weights into new heap pages (half its 4.9-5.3 s is the kernel zeroing them). ONNX Runtime can write the optimized
graph with the prepacked weights in its external data file (`session.save_external_prepacked_constant_initializers`)
and map them at the next load (2.0-2.3 s and 1.4-1.7 s there; the route's packed weights then file pages, not
heap). The first load of a graph makes its session that way (its one cost: writing the copy, 5.2 GB for the 4b's
step graph and 7.5 GB for its route, into the user's cache; never beside the export, which may be read-only) and
runs a probe on it (a short prefill and one step, seeded); the next load opens the prepared copy and runs the same
probe: outputs bit-equal to the original graph's, the copy is used from then on; any difference, and it is deleted
and the original graph loaded (then and every later time, said once).

The entry's key: the graph file's and each external data file's identity (path, size, mtime, inode, device), the
onnxruntime version, this CPU's flags and `PREPARE_VERSION`; its stamp (`STAMP`, written last) says where the
entry stands: "unchecked" (the probe's outputs of the original kept beside it), "equal", or "differs".
`$HIGGS_PREPARED=0` loads the original graph every time (nothing written), and so does a build (`held_off`, around
`export.Exporter.run`: its staging folders are loaded for the gates, then renamed; a copy of them would be waste).

    part = open_prepared("llm_step", path, "cpu", threads, probe)    # a runtime.session.Part (llm_route alike)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..hash_verdicts import identity
from ..outputs import write_atomic
from ..user_cache import CacheError, cache_dir, cache_writes
from .session import Part

log = logging.getLogger(__name__)

CACHE_KIND = "prepared"
PREPARE_VERSION = 1  # bump when the entry changes: the key holds it
STAMP = "entry.json"
PROBE = "probe.npz"  # the original graph's outputs on the probe (while the entry is unchecked)
ENV = "HIGGS_PREPARED"
# graphs whose load is mostly their weights' repacking (measured on the 4b: see the module's docstring)
PREPARED_PARTS = ("llm_step", "llm_decoder", "llm_route")
# free space asked of the cache, times the graph's data files (4b: the step's copy 5.2 GB for 2.3 GB of data; the
# route's 7.5 GB for 6.1 GB, most of its int4 file unused)
SPACE_FACTOR = 3


@contextmanager
def held_off() -> Iterator[None]:
    """No graph prepared while the block runs, in this process and the ones it starts (a build: its part steps
    run in child processes): `$HIGGS_PREPARED=0` for the block, what it was put back after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def data_files(graph: Path) -> list[Path]:
    """The external data files `graph` names (without loading the weights)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    names = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return sorted(graph.parent / n for n in names)


def entry_key(graph: Path, data: list[Path]) -> str:
    import onnxruntime as ort

    from .route import cpu_flags

    def ident(path: Path) -> dict:  # not the ctime, which a hard link made elsewhere moves
        return {k: v for k, v in identity(path).items() if k != "ctime_ns"}

    facts = {"graph": ident(graph), "data": [ident(p) for p in data], "ort": ort.__version__,
             "cpu": sorted(cpu_flags()), "version": PREPARE_VERSION}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def read_stamp(folder: Path) -> str | None:
    """The entry's state ("unchecked", "equal", "differs"), None when there is no sound stamp."""
    try:
        state = json.loads((folder / STAMP).read_text(encoding="utf-8")).get("state")
    except (OSError, ValueError, AttributeError):
        return None
    return state if state in ("unchecked", "equal", "differs") else None


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
                                    for x, y in zip(a, b, strict=True))


def open_prepared(name: str, graph: Path, provider: str, threads: int,
                  probe: Callable[[Part], list[np.ndarray]]) -> Part:
    """The part's session from its prepared copy where that gated bit-equal, else from `graph` (preparing the copy
    on the first load: see the module's docstring). `probe(part)`: the outputs compared, seeded and the same every
    time."""
    if os.environ.get(ENV, "1").strip() == "0":
        return Part(name, graph, provider, threads)
    try:
        data = data_files(graph)
    except Exception:  # noqa: BLE001 - a damaged graph (protobuf's errors): the original's load says it in one line
        return Part(name, graph, provider, threads)
    folder = cache_dir(CACHE_KIND, entry_key(graph, data), make=False)
    state = read_stamp(folder)
    if state == "differs":
        return Part(name, graph, provider, threads)
    if state == "equal":
        return Part(name, folder / graph.name, provider, threads)
    if state == "unchecked":
        return check_entry(name, graph, folder, provider, threads, probe)
    return prepare(name, graph, data, provider, threads, probe)


def prune(graph: Path, keep: Path) -> list[Path]:
    """Delete the entries no load can use any more (each holds GBs for the 4b): those made for `graph` under another
    identity (the file was rebuilt or changed) and those whose graph is gone (a rebuilt export, a build's staging).
    An entry being made (no stamp yet) is left. A session still mapping a deleted entry keeps its pages (POSIX)."""
    gone = []
    for entry in keep.parent.iterdir():
        if entry == keep:
            continue
        try:
            made_for = json.loads((entry / STAMP).read_text(encoding="utf-8")).get("graph")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(made_for, str) and (made_for == str(graph) or not Path(made_for).is_file()):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry)
    if gone:
        log.info("prepared graphs: %d entries of changed or deleted graphs removed", len(gone))
    return gone


def prepare(name: str, graph: Path, data: list[Path], provider: str, threads: int, probe) -> Part:
    """The first load: the session made from `graph` writing its optimized copy with the prepacked weights into a
    new entry, the probe's outputs kept; the entry stays "unchecked" until the next load. Too little space, or a
    cache that cannot be written: the original alone (said at info level)."""
    weights = sum(p.stat().st_size for p in data)
    try:
        folder = cache_dir(CACHE_KIND, entry_key(graph, data))
    except CacheError as e:
        log.info("%s: not prepared for fast loads (%s)", name, e)
        return Part(name, graph, provider, threads)
    prune(graph, keep=folder)  # before the space is counted: what it frees counts
    free = shutil.disk_usage(folder).free
    if free < SPACE_FACTOR * weights:
        log.info("%s: not prepared for fast loads: %.1f GB free in %s, %.1f GB wanted", name, free / 1e9, folder,
                 SPACE_FACTOR * weights / 1e9)
        return Part(name, graph, provider, threads)
    (folder / STAMP).unlink(missing_ok=True)
    log.info("%s: preparing its graph with prepacked weights in %s (once per file identity)", name, folder)
    saving = {"session.optimized_model_external_initializers_file_name": f"{graph.name}.data",
              "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
              "session.save_external_prepacked_constant_initializers": "1"}
    try:
        part = Part(name, graph, provider, threads, optimized=(folder / graph.name, saving))
    except RuntimeError as e:  # the copy could not be written (a full disk ...): the original alone
        log.info("%s: not prepared for fast loads (%s)", name, str(e)[:160])
        return Part(name, graph, provider, threads)
    try:
        with cache_writes(folder):
            np.savez(folder / PROBE, *probe(part))
            write_atomic(folder / STAMP, json.dumps({"state": "unchecked", "graph": str(graph)}) + "\n")
    except CacheError as e:  # no stamp: prepared again next time
        log.info("%s: its prepared graph cannot be kept (%s)", name, e)
    return part


def check_entry(name: str, graph: Path, folder: Path, provider: str, threads: int, probe) -> Part:
    """The second load: the prepared copy opened and probed; bit-equal to the original's outputs: "equal" (used
    from now on), else "differs" (the copy deleted, the original loaded)."""
    try:
        with np.load(folder / PROBE, allow_pickle=False) as kept:
            expected = [kept[k] for k in kept.files]
        part = Part(name, folder / graph.name, provider, threads)
        got = probe(part)
    except Exception as e:  # noqa: BLE001 - a damaged entry (ORT's or NumPy's errors): the original graph
        log.warning("%s: its prepared graph in %s does not load (%s): the original graph is loaded", name, folder,
                    str(e)[:120])
        part, got, expected = None, [], [None]
    state = "equal" if part is not None and same(expected, got) else "differs"
    if state == "differs":
        if part is not None:
            log.warning("%s: its prepared graph's outputs differ from the original graph's: the original is loaded "
                        "(now and later)", name)
        part = None
        for f in folder.iterdir():
            if f.name != STAMP:
                f.unlink(missing_ok=True)
    try:
        with cache_writes(folder):
            write_atomic(folder / STAMP, json.dumps({"state": state, "graph": str(graph)}) + "\n")
            (folder / PROBE).unlink(missing_ok=True)
    except CacheError as e:
        log.info("%s: the prepared graph's verdict cannot be kept (%s)", name, e)
    return part if part is not None else Part(name, graph, provider, threads)
