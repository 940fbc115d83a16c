"""A decoder graph built for another EP, made runnable on ONNX Runtime's CPU provider.

ModelBuilder's `-e cuda` build fuses Qwen3's per-head q_norm/k_norm into GroupQueryAttention (its `q_norm_weight` /
`k_norm_weight` inputs), which the CPU EP refuses ("q_norm_weight / k_norm_weight inputs are not supported").
`cpu_ready` moves each fused norm out in front of the attention node as standard steps the CPU EP runs
(Reshape to [B, S, heads, head_dim] -> SimplifiedLayerNormalization over head_dim with the norm's weight -> Reshape
back; a packed QKV query is Split into its Q, K and V heads first and Concat back), so RoPE, inside the attention
node, still follows the norm as in Qwen3. Its int4 MatMulNBits get the CPU's accuracy level (4: int8 activations, as
a cpu int4 export has them; a cuda build leaves 0). The rewritten graph is written to the user's cache (never beside
the original: the folder may be read-only), its external data files hard-linked there under their own names (copied
when the cache is on another filesystem), and last a stamp (`entry.json`: the graph's size and sha256, each data
file's size and inode) that is checked each time the entry is reused: a damaged entry is rebuilt. Before it is
kept, the rewrite of the first fused node is run as a one-node graph on the CPU EP and compared with a NumPy
reference of the fused op (norm, rotary, grouped causal attention).

    path = cpu_ready("onnx/cuda_int4/llm_decoder.onnx")   # the original path when nothing needs rewriting
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from .. import providers
from ..user_cache import cache_dir, cache_writes
from .cpu_graph_check import CPU_EP, DEFAULT_EPS, GQA, K_NORM, MS, Q_NORM, attrs_of, self_check

log = logging.getLogger(__name__)

CACHE_KIND = "cpu-graphs"
REWRITE_VERSION = 3  # bump when the rewrite or the entry changes: the cache key holds it (3: the stamp)
STAMP = "entry.json"  # an entry's last file: what its graph and data files must be (`entry_damage`)
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT)  # a copy would fail as the link did
NORM_ATTRS = ("qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon")
# the cost the warning states, by the folder's precision: a decode step against a cpu int4 export's, measured on an
# h1024 L8 synthetic model, 2 threads of an AVX2 EPYC (docs/devices.md, "A cuda folder on a machine without a GPU")
SLOWER = {"int4": "about 1.2-1.3 x", "fp16": "about 3-4 x"}


def is_fused(node) -> bool:
    """A GroupQueryAttention node that normalizes Q or K itself (the inputs the CPU EP refuses)."""
    return (node.op_type == GQA and node.domain == MS
            and any(len(node.input) > i and node.input[i] for i in (Q_NORM, K_NORM)))


def cpu_ready(graph_path: str | os.PathLike) -> Path:
    """A path of the graph that the CPU EP can run (and runs fast): `graph_path` itself when it has no fused q/k
    norms and no int4 MatMulNBits below the CPU's accuracy level, else the rewritten graph in the user's cache (made
    once per graph file, data files, rewrite and onnxruntime version; reused while its stamp holds, rebuilt with one
    warning line when damaged). ValueError (one line, naming the node) when a node has no CPU kernel at all;
    `user_cache.CacheError` when the cache cannot be written."""
    import onnx

    path = Path(graph_path)
    raw = path.read_bytes()  # the graph only: its weights stay in the external data files
    model = onnx.load_from_string(raw)
    fused = [i for i, n in enumerate(model.graph.node) if is_fused(n)]
    slow = [i for i, n in enumerate(model.graph.node) if below_cpu_accuracy(n)]
    check_kernels(model, path.name, skip=fused)
    if not fused and not slow:
        return path
    locations = external_locations(model, path)
    key = cache_key(raw, path.parent, locations)
    folder = cache_dir(CACHE_KIND, key, make=False)  # a sound entry is read, even from a read-only cache
    damage = entry_damage(folder, path, locations)
    if damage is None:
        return folder / path.name
    if damage:
        log.warning("%s: the cached CPU rewrite in %s is damaged (%s): rebuilding it", path, folder, damage)
    if fused:  # before the rewrite: the check rewrites a model of its own
        self_check(model.graph, model.graph.node[fused[0]], unfuse)
    for i in slow:  # int8 activations on the CPU's int4 kernels, as a cpu int4 export has them
        set_accuracy(model.graph.node[i], providers.BUILD_PROVIDER.int4_accuracy)
    unfuse(model, fused)
    out = write_entry(cache_dir(CACHE_KIND, key), path, model.SerializeToString(), locations)
    log.info("%s: %d fused q/k norm(s) moved out of GroupQueryAttention, %d MatMulNBits at accuracy level %d for the "
             "CPU EP -> %s", path, len(fused), len(slow), providers.BUILD_PROVIDER.int4_accuracy, out)
    return out


def write_entry(folder: Path, path: Path, graph: bytes, locations: list[str]) -> Path:
    """The cache entry of `path`'s rewrite (`graph`, serialized) in `folder`: its data files linked, the graph, then
    the stamp (`STAMP`: what the entry holds; its presence says the entry is complete). Returns the graph's path."""
    out = folder / path.name
    with cache_writes(folder):
        (folder / STAMP).unlink(missing_ok=True)  # an entry being rebuilt is not complete
        data = {}
        for loc in locations:
            mode = link_data(path.parent / loc, folder / loc)
            st = os.lstat(folder / loc)
            data[loc] = {"mode": mode, "size": st.st_size, "ino": st.st_ino, "dev": st.st_dev,
                         "mtime_ns": st.st_mtime_ns}
        _write_atomic(out, graph)
        stamp = {"graph": {"size": len(graph), "sha256": hashlib.sha256(graph).hexdigest()}, "data": data}
        _write_atomic(folder / STAMP, json.dumps(stamp, indent=1).encode())
    return out


def entry_damage(folder: Path, path: Path, locations: list[str]) -> str | None:
    """None when `folder` holds a sound rewrite of `path` (its stamp's graph size and sha256; each data file the
    original's size and, linked, the original's inode, copied, the copy's inode and mtime); "" when there is no entry
    yet; else what is wrong, in a few words."""
    if not (folder / STAMP).is_file():
        return "no stamp: an unfinished build" if folder.is_dir() and any(folder.iterdir()) else ""
    try:
        stamp = json.loads((folder / STAMP).read_text(encoding="utf-8"))
        graph, data = stamp["graph"], stamp["data"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {STAMP} is unreadable"
    try:
        body = (folder / path.name).read_bytes()
    except OSError:
        return f"{path.name} is missing"
    if len(body) != graph.get("size") or hashlib.sha256(body).hexdigest() != graph.get("sha256"):
        return f"{path.name} is {len(body)} bytes and does not match its sha256"
    for loc in locations:
        kept = data.get(loc) or {}
        try:
            st, src = os.lstat(folder / loc), (path.parent / loc).stat()
        except OSError:
            return f"{loc} is missing"
        if st.st_size != src.st_size:
            return f"{loc} is {st.st_size} bytes, the original {src.st_size}"
        hard = kept.get("mode") == "hard"
        want = (src.st_ino, src.st_dev) if hard else (kept.get("ino"), kept.get("dev"), kept.get("mtime_ns"))
        if ((st.st_ino, st.st_dev) if hard else (st.st_ino, st.st_dev, st.st_mtime_ns)) != want:
            return f"{loc} is no longer {'a link to' if hard else 'the copy it made of'} {path.parent / loc}"
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def default_provider(manifest) -> str:
    """The provider a folder runs on when none was asked for: the device it was built for, or the CPU provider (one
    warning line, with its cost) when that device's EP is not in the installed onnxruntime and the CPU runs it."""
    import onnxruntime as ort

    built, host = providers.get(manifest.device), providers.BUILD_PROVIDER
    if built.ort_name is None or built.ort_name in ort.get_available_providers() or built.name not in host.runs:
        return built.name
    inputs = manifest.parts.get("llm_decoder", {}).get("inputs", [])
    half = any(x.get("dtype") == "float16" for x in inputs)
    log.warning("%s is a %s export and this onnxruntime has no %s: running it on the %s provider (%sfused q/k norms "
                "split out: %s slower per decode step than a %s int4 export) - build one with `python optimize.py "
                "--device %s --precision int4` or fetch a %s folder", manifest.folder, built.name, built.ort_name,
                host.name, "float16 activations and KV cache, " if half else "",
                SLOWER.get(manifest.precision, "measurably"), host.name, host.name, host.name)
    return host.name


def graph_for(manifest, name: str, provider: str) -> Path:
    """The graph file part `name` runs from on `provider`: the manifest's, or its rewrite (`cpu_ready`) when the
    provider splits fused q/k norms and the folder was built for another device."""
    path = manifest.part_file(name)
    p = providers.get(provider)
    if p.splits_qk_norm and manifest.device != p.name and path.suffix == ".onnx":
        return cpu_ready(path)
    return path


def below_cpu_accuracy(node) -> bool:
    """An int4 MatMulNBits below the CPU's accuracy level (a cuda build leaves it at 0: fp16 activations, measured
    about 2 x slower per decode step on the CPU than level 4; docs/devices.md)."""
    if node.op_type != "MatMulNBits" or node.domain != MS:
        return False
    return attrs_of(node).get("accuracy_level", 0) < providers.BUILD_PROVIDER.int4_accuracy


def set_accuracy(node, level: int) -> None:
    from onnx import helper

    keep = [a for a in node.attribute if a.name != "accuracy_level"]
    del node.attribute[:]
    node.attribute.extend([*keep, helper.make_attribute("accuracy_level", level)])


def cpu_kernels() -> set[tuple[str, str]]:
    """(domain, op) pairs the installed onnxruntime's CPU EP has a kernel for ("" is the ONNX domain)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    return {(k.domain or "", k.op_name) for k in C.get_all_opkernel_def() if k.provider == CPU_EP}


def check_kernels(model, name: str, skip=()) -> None:
    """ValueError naming the first node (outside `skip`, the indices of the nodes the rewrite takes care of) whose op
    has no CPU kernel in this onnxruntime."""
    import onnxruntime as ort

    kernels = cpu_kernels()
    for i, n in enumerate(model.graph.node):
        domain = "" if n.domain in ("", "ai.onnx") else n.domain
        if i not in skip and (domain, n.op_type) not in kernels and not _expanded(domain, n.op_type):
            op = f"{domain}.{n.op_type}" if domain else n.op_type
            raise ValueError(f"{name}: node {n.name or '(unnamed)'} ({op}) has no CPU kernel in onnxruntime "
                             f"{ort.__version__}, so this graph cannot run on --provider cpu; use a cpu export "
                             f"(python optimize.py --device cpu ...)")


def _expanded(domain: str, op: str) -> bool:
    """An op ONNX Runtime runs without a kernel of its own: Constant (an initializer once loaded) or an ONNX function
    (expanded into its body)."""
    import onnx

    if domain == "" and op == "Constant":
        return True
    try:
        schema = onnx.defs.get_schema(op, domain)
    except onnx.defs.SchemaError:
        return False
    return schema.has_function or schema.has_context_dependent_function


def external_locations(model, path: Path) -> list[str]:
    """The external data files the graph's tensors name (relative to its folder; checked to stay inside it)."""
    tensors = list(model.graph.initializer)
    tensors += [a.t for n in model.graph.node for a in n.attribute if a.HasField("t")]
    found = {e.value for t in tensors for e in t.external_data if e.key == "location"}
    for loc in found:
        if Path(loc).is_absolute() or ".." in Path(loc).parts:
            raise ValueError(f"{path.name}: external data location {loc!r} leaves the graph's folder")
        if not (path.parent / loc).is_file():
            raise FileNotFoundError(f"{path.name}: its external data file {path.parent / loc} is missing")
    return sorted(found)


def cache_key(raw: bytes, folder: Path, locations: list[str]) -> str:
    """The graph's bytes, each data file's size and mtime, the rewrite version and onnxruntime's version."""
    import onnxruntime as ort

    h = hashlib.sha256(raw)
    for loc in locations:
        st = (folder / loc).stat()
        h.update(f"|{loc}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(f"|rewrite {REWRITE_VERSION}|ort {ort.__version__}".encode())
    return h.hexdigest()[:32]


def link_data(src: Path, dst: Path, modes: tuple[str, ...] = ("hard", "copy")) -> str:
    """`dst` made to reach `src`'s bytes: a hard link (same filesystem), else (logged) a copy. No symlink: ONNX Runtime
    1.32 refuses external data whose real path leaves the graph's folder ("External data path escapes model
    directory"). Atomic (temp name + rename); a `dst` that is already a hard link of `src` is kept as it is (renaming
    one link of a file onto another is a no-op that would leave the temp name behind). Returns the mode used. The
    OSError of a cache that cannot be written (read-only, full, not ours) is raised as it is, without a copy."""
    src = src.resolve()
    dst.parent.mkdir(parents=True, exist_ok=True)
    if "hard" in modes and _same_file(src, dst):
        return "hard"
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    error: OSError | None = None
    for mode in modes:
        tmp.unlink(missing_ok=True)
        try:
            if mode == "hard":
                os.link(src, tmp)
            else:
                log.warning("%s: copying %s into the cache (%.1f MB): no hard link can be made there (another "
                            "filesystem? set $HIGGS_CACHE to a folder on the model's)", dst.parent, src.name,
                            src.stat().st_size / 1e6)
                shutil.copyfile(src, tmp)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in UNWRITABLE:
                raise
            error = e
            continue
        os.replace(tmp, dst)
        tmp.unlink(missing_ok=True)  # still there if another process linked dst to the same file meanwhile
        return mode
    raise error or OSError(f"cannot link or copy {src} to {dst}")


def _same_file(a: Path, b: Path) -> bool:
    """`b` (not followed if a link) is the file `a` is."""
    try:
        sa, sb = a.stat(), os.lstat(b)
    except OSError:
        return False
    return (sa.st_ino, sa.st_dev) == (sb.st_ino, sb.st_dev)


# -- the rewrite ------------------------------------------------------------------------------------------------
def unfuse(model, fused) -> None:
    """The fused nodes' (indices into the graph's nodes) Q/K norms moved in front of them, in place; each node loses
    its norm inputs and attributes."""
    from onnx import NodeProto, helper, numpy_helper

    graph, fused = model.graph, set(fused)
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), "cpu_unfuse/flat_shape"))
    nodes = []
    for i, node in enumerate(graph.node):
        if i in fused:
            nodes += _norm_nodes(graph, node, f"cpu_unfuse/{i}")
            inputs = list(node.input) + [""] * max(0, K_NORM + 1 - len(node.input))
            inputs[Q_NORM] = inputs[K_NORM] = ""
            while inputs and not inputs[-1]:
                inputs.pop()
            keep = [a for a in node.attribute if a.name not in NORM_ATTRS]
            node = helper.make_node(node.op_type, inputs, list(node.output), node.name, domain=node.domain)
            node.attribute.extend(keep)
        else:
            node = _copy(node, NodeProto)  # the graph's own nodes are cleared below
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _copy(message, kind):
    c = kind()
    c.CopyFrom(message)
    return c


def _norm_nodes(graph, node, prefix: str) -> list:
    """The nodes that normalize the fused node's Q and K heads; rewires its query (and key) inputs to them."""
    from onnx import helper, numpy_helper

    a = attrs_of(node)
    eps = a.get("qk_norm_epsilon", DEFAULT_EPS)
    heads = {"q": a["num_heads"], "k": a["kv_num_heads"]}
    weights = {"q": node.input[Q_NORM] if len(node.input) > Q_NORM else "", "k": node.input[K_NORM]
               if len(node.input) > K_NORM else ""}
    epsilon = {"q": a.get("q_norm_epsilon", eps), "k": a.get("k_norm_epsilon", eps)}
    out: list = []

    def shape(name: str, values: list[int]) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), f"{prefix}/{name}"))
        return f"{prefix}/{name}"

    def norm(x: str, which: str) -> str:  # x: [B, S, heads, head_dim]
        y = f"{prefix}/{which}_normed"
        out.append(helper.make_node("SimplifiedLayerNormalization", [x, weights[which]], [y], f"{prefix}/{which}_norm",
                                    axis=-1, epsilon=float(epsilon[which]), stash_type=1))
        return y

    packed = len(node.input) < 2 or not node.input[1]
    if packed:  # query holds Q, K and V heads side by side
        q4 = f"{prefix}/qkv_heads"
        out.append(helper.make_node("Reshape", [node.input[0], shape("qkv_shape", [0, 0, heads["q"] + 2 *
                                    heads["k"], -1])], [q4], f"{prefix}/qkv_reshape"))
        parts = [f"{prefix}/{w}_heads" for w in ("q", "k", "v")]
        split = shape("split", [heads["q"], heads["k"], heads["k"]])
        out.append(helper.make_node("Split", [q4, split], parts, f"{prefix}/split", axis=2))
        parts[0] = norm(parts[0], "q") if weights["q"] else parts[0]
        parts[1] = norm(parts[1], "k") if weights["k"] else parts[1]
        cat, flat = f"{prefix}/qkv_normed", f"{prefix}/qkv_flat"
        out.append(helper.make_node("Concat", parts, [cat], f"{prefix}/concat", axis=2))
        out.append(helper.make_node("Reshape", [cat, "cpu_unfuse/flat_shape"], [flat], f"{prefix}/qkv_back"))
        node.input[0] = flat
        return out
    for slot, which in ((0, "q"), (1, "k")):
        if not weights[which]:
            continue
        x4, flat = f"{prefix}/{which}_heads", f"{prefix}/{which}_flat"
        out.append(helper.make_node("Reshape", [node.input[slot], shape(f"{which}_shape", [0, 0, heads[which], -1])],
                                    [x4], f"{prefix}/{which}_reshape"))
        out.append(helper.make_node("Reshape", [norm(x4, which), "cpu_unfuse/flat_shape"], [flat],
                                    f"{prefix}/{which}_back"))
        node.input[slot] = flat
    return out

