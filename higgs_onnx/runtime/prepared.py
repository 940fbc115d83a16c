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
onnxruntime version, this CPU's flags and `PREPARE_VERSION`; its stamp (`STAMP`) says where the entry stands:
"unchecked" (the probe's outputs of the original kept beside it), "equal", or "differs", and the identity of each
file of the copy as it was written. An entry is made in a temporary folder of its own and renamed into place whole,
so no load sees one half-written (two processes preparing at once, a process killed meanwhile); a copy whose files
are not the ones its stamp names (changed, truncated, deleted), or that ONNX Runtime cannot load, is prepared anew:
the prepared cache never fails a load nor changes its outputs. Temporary folders a killed process left are removed by
the next prepare (their lock unheld). `$HIGGS_PREPARED`: 1 or unset prepares (the default), 0 loads the original
graph every time (nothing written), anything else is refused at load; a build holds it at 0 (`held_off`, around
`export.Exporter.run`: its staging folders are loaded for the gates, then renamed; a copy of them would be waste).

    part = open_prepared("llm_step", path, "cpu", threads, probe)    # a runtime.session.Part (llm_route alike)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..hash_verdicts import identity
from ..outputs import write_atomic
from ..user_cache import CacheError, cache_dir, cache_writes, read_kept
from .session import Part

log = logging.getLogger(__name__)

CACHE_KIND = "prepared"
PREPARE_VERSION = 2  # bump when the entry changes: the key holds it (2: the stamp names the copy's files)
STAMP = "entry.json"
STAMP_BYTES = 2**16  # a stamp names a graph and its few files: a larger "stamp" is not one (not read)
PROBE = "probe.npz"  # the original graph's outputs on the probe (while the entry is unchecked)
LOCK = "lock"  # in a temporary folder: held (flock) by the process making it, released by the kernel if it is killed
ENV = "HIGGS_PREPARED"
# graphs whose load is mostly their weights' repacking (measured on the 4b: see the module's docstring)
PREPARED_PARTS = ("llm_step", "llm_decoder", "llm_route")
# free space asked of the cache, times the graph's data files (4b: the step's copy 5.2 GB for 2.3 GB of data; the
# route's 7.5 GB for 6.1 GB, most of its int4 file unused)
SPACE_FACTOR = 3
FILE_ID = ("size", "mtime_ns", "ctime_ns", "ino", "dev")  # a copy's file as written (an entry's rename keeps them)
ABANDONED_S = 3600  # a folder without stamp or lock untouched this long is a killed process's (a prepare: 30 s)


def enabled() -> bool:
    """Whether graphs are prepared: `$HIGGS_PREPARED` 1 or unset (the default), 0 not; anything else is a ValueError
    (a load checks it first, `runtime.parts.ModelParts`)."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"${ENV} must be 0 (load the original graphs) or 1 (prepare them, the default), got "
                         f"{value[:40]!r}")
    return value != "0"


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


def read_stamp(folder: Path) -> dict | None:
    """The entry's stamp ({"state": "unchecked" | "equal" | "differs", "graph", "files"}), None when it has no sound
    one."""
    try:
        stamp = json.loads(read_kept(folder / STAMP, STAMP_BYTES) or "null")
    except (ValueError, RecursionError):
        return None
    if (not isinstance(stamp, dict) or stamp.get("state") not in ("unchecked", "equal", "differs")
            or not isinstance(stamp.get("graph"), str) or not isinstance(stamp.get("files"), dict)):
        return None
    return stamp


def files_of(folder: Path) -> dict[str, dict]:
    """The copy's files in an entry folder (not its stamp, the probe's outputs, the lock) by name: their `FILE_ID`."""
    out = {}
    for f in folder.iterdir():
        if f.name not in (STAMP, PROBE, LOCK):
            st = f.stat()
            out[f.name] = {k: getattr(st, f"st_{k}") for k in FILE_ID}
    return out


def intact(folder: Path, stamp: dict) -> bool:
    """Whether the entry's files are the ones its stamp names, each as it was written."""
    try:
        return files_of(folder) == stamp["files"]
    except OSError:
        return False


def stamp_entry(folder: Path, state: str, graph: Path, files: dict) -> None:
    write_atomic(folder / STAMP, json.dumps({"state": state, "graph": str(graph), "files": files}) + "\n")


def discard(folder: Path) -> None:
    """The entry removed: renamed aside first (another load may be reading it; a session mapping its files keeps
    them, POSIX), then deleted."""
    aside = folder.with_name(f".{folder.name}.{secrets.token_hex(4)}.gone")
    try:
        os.rename(folder, aside)
    except OSError:
        return
    remove(aside)


def remove(path: Path) -> None:
    """A folder with what it holds, or a file (what a user or a disk left where an entry was expected)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)
                                    for x, y in zip(a, b, strict=True))


def open_prepared(name: str, graph: Path, provider: str, threads: int,
                  probe: Callable[[Part], list[np.ndarray]]) -> Part:
    """The part's session from its prepared copy where that gated bit-equal, else from `graph` (preparing the copy
    on the first load: see the module's docstring). `probe(part)`: the outputs compared, seeded and the same every
    time."""
    if not enabled():
        return Part(name, graph, provider, threads)
    try:
        data = data_files(graph)
    except Exception:  # noqa: BLE001 - a damaged graph (protobuf's errors): the original's load says it in one line
        return Part(name, graph, provider, threads)
    folder = cache_dir(CACHE_KIND, entry_key(graph, data), make=False)
    stamp = read_stamp(folder) or {"state": None}
    if stamp["state"] == "differs":
        return Part(name, graph, provider, threads)
    if stamp["state"] in ("equal", "unchecked") and not intact(folder, stamp):
        log.warning("%s: its prepared graph in %s changed since it was written: prepared again", name, folder)
        discard(folder)
    elif stamp["state"] == "unchecked":
        return check_entry(name, graph, folder, stamp, provider, threads, probe)
    elif stamp["state"] == "equal":
        try:
            return Part(name, folder / graph.name, provider, threads)
        except RuntimeError as e:  # a damage its files' identities do not show: prepared again
            log.warning("%s: its prepared graph in %s does not load (%s): prepared again", name, folder, str(e)[:120])
            discard(folder)
    return prepare(name, graph, data, provider, threads, probe)  # a folder there without a sound stamp: replaced


def prune(graph: Path, keep: Path) -> list[Path]:
    """Delete the entries no load can use any more (each holds GBs for the 4b): those made for `graph` under another
    identity (the file was rebuilt or changed), those whose graph is gone (a rebuilt export, a build's staging), and
    what killed processes left (`abandoned`). A session still mapping a deleted entry keeps its pages (POSIX)."""
    gone = []
    for entry in keep.parent.iterdir():
        if entry == keep:
            continue
        made_for = None if entry.name.startswith(".") else graph_of(entry)
        stale = abandoned(entry) if made_for is None else made_for == str(graph) or not Path(made_for).is_file()
        if stale:
            remove(entry)
            gone.append(entry)
    if gone:
        log.info("prepared graphs: %d entries no load can use removed (changed or deleted graphs, killed prepares)",
                 len(gone))
    return gone


def graph_of(entry: Path) -> str | None:
    """The graph an entry was made for, as its stamp names it (any `PREPARE_VERSION`'s: an older entry of the same
    graph is removed at once, not after an hour); None without one."""
    try:
        made_for = json.loads(read_kept(entry / STAMP, STAMP_BYTES) or "null").get("graph")
    except (ValueError, RecursionError, AttributeError):
        return None
    return made_for if isinstance(made_for, str) else None


def abandoned(entry: Path) -> bool:
    """Whether a temporary folder, or an entry without a sound stamp, is a killed process's: a prepare's whose lock
    nobody holds, anything else untouched for `ABANDONED_S`."""
    from filelock import FileLock, Timeout

    try:
        if entry.name.endswith(".partial"):
            lock = FileLock(str(entry / LOCK), thread_local=False)
            lock.acquire(timeout=0)
            lock.release()
            return True
        return time.time() - entry.stat().st_mtime > ABANDONED_S
    except (Timeout, OSError):  # being made; or gone meanwhile
        return False


def prepare(name: str, graph: Path, data: list[Path], provider: str, threads: int, probe) -> Part:
    """The first load: the session made from `graph` writing its optimized copy with the prepacked weights into a
    temporary folder, the probe's outputs kept, the folder renamed into place as an "unchecked" entry (checked by the
    next load). Too little space, a cache that cannot be written, a copy that cannot be made: the original alone
    (said at info level), nothing left behind."""
    from filelock import FileLock

    weights = sum(p.stat().st_size for p in data)
    folder = cache_dir(CACHE_KIND, entry_key(graph, data), make=False)
    try:
        tmp = cache_dir(CACHE_KIND, f".{folder.name}.{secrets.token_hex(4)}.partial")
    except CacheError as e:
        log.info("%s: not prepared for fast loads (%s)", name, e)
        return Part(name, graph, provider, threads)
    part, held = None, FileLock(str(tmp / LOCK), thread_local=False)
    try:
        held.acquire()
        prune(graph, keep=folder)  # before the space is counted: what it frees counts
        free = shutil.disk_usage(tmp).free
        if free < SPACE_FACTOR * weights:
            log.info("%s: not prepared for fast loads: %.1f GB free in %s, %.1f GB wanted", name, free / 1e9,
                     folder.parent, SPACE_FACTOR * weights / 1e9)
            return Part(name, graph, provider, threads)
        log.info("%s: preparing its graph with prepacked weights in %s (once per file identity)", name, folder)
        saving = {"session.optimized_model_external_initializers_file_name": f"{graph.name}.data",
                  "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
                  "session.save_external_prepacked_constant_initializers": "1"}
        try:
            part = Part(name, graph, provider, threads, optimized=(tmp / graph.name, saving))
        except RuntimeError as e:  # the copy could not be written (a full disk ...): the original alone
            log.info("%s: not prepared for fast loads (%s)", name, str(e)[:160])
            return Part(name, graph, provider, threads)
        with cache_writes(tmp):
            np.savez(tmp / PROBE, *probe(part))
            stamp_entry(tmp, "unchecked", graph, files_of(tmp))
        install(tmp, folder)
    except (CacheError, OSError) as e:
        log.info("%s: its prepared graph cannot be kept (%s)", name, e)
    finally:
        held.release()
        remove(tmp)  # gone already once installed
    return part


def install(tmp: Path, folder: Path) -> None:
    """A finished entry renamed into place. Another process's sound entry there already stays (ours is dropped);
    anything else there is discarded first."""
    for _ in range(2):
        try:
            os.rename(tmp, folder)
            return
        except OSError:
            if read_stamp(folder) is not None:
                return
            discard(folder)


def check_entry(name: str, graph: Path, folder: Path, stamp: dict, provider: str, threads: int, probe) -> Part:
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
                remove(f)
    try:
        with cache_writes(folder):
            stamp_entry(folder, state, graph, stamp["files"] if state == "equal" else {})
            (folder / PROBE).unlink(missing_ok=True)
    except CacheError as e:
        log.info("%s: the prepared graph's verdict cannot be kept (%s)", name, e)
    return part if part is not None else Part(name, graph, provider, threads)
