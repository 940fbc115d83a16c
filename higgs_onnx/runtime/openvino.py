"""Parts run by the OpenVINO runtime itself (not through an ONNX Runtime EP); the ONNX -> IR conversion that builds
the decoder for it is `parts.openvino_ir`.

    part = OvPart("llm_decoder", Path("onnx/openvino_int4/llm_decoder.xml"), threads=2)
    out = part(inputs_embeds=x, attention_mask=m, **past)          # {output name: ndarray}, like session.Part
    dec = OvPart("llm_decoder", xml, stateful=True)               # the KV cache held as the model's state
    state = dec.new_state({past name: (1, KV heads, 0, head dim) array, ...}); state.infer(inputs_embeds=..., ...)

`OvPart` has `session.Part`'s interface: `name`, `path`, `input_types` (name -> NumPy dtype), `output_names`, and a
`session` whose `get_inputs()` / `get_outputs()` give `.name`, `.shape` (ints; the ONNX dim names for dynamic axes)
and `.type` ("tensor(float)" ...) like ONNX Runtime's, plus `get_modelmeta().custom_metadata_map` (the ONNX file's
`metadata_props`; kept in the IR's rt_info by `parts.openvino_ir.to_ir`). It reads a `.onnx` file (OpenVINO's ONNX
front end) or an `.xml` IR. Loading refuses, as `ProviderError` naming the part, the op and a node: an op the ONNX
front end cannot convert, an op the device does not support (`Core.query_model`), and a compiled model that runs
anywhere but the requested device (`EXECUTION_DEVICES`, no HETERO/AUTO fallback). Calls are thread-safe: each takes
an infer request from a small pool (one per concurrent caller).

Facts measured here (openvino 2026.4.1, nncf 3.4.0, onnxruntime 1.32.0; 2-core AMD EPYC with AVX-512, VNNI and
AVX-512-BF16, no AMX):
- The ONNX front end reads ModelBuilder's contrib ops: GroupQueryAttention (kept as one OpenVINO op of opset
  "extension"; an IR holding it reads back only with `openvino.op._GroupQueryAttentionExtension` registered, which
  `core()` does), SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization (decomposed), MatMulNBits and
  GatherBlockQuantized (decomposed to Convert/Subtract/Multiply + MatMul/Gather). `query_model` reports every
  node of all six parts of a tiny cpu_int4 export supported on CPU. An op the front end lacks (com.microsoft
  Inverse, which ORT's CPU EP runs) fails `read_model` ("No conversion rule found for operations: ...").
- `INFERENCE_PRECISION_HINT` exists and on this CPU **defaults to bf16**. At bf16 the tiny fp32 parts drift from
  ORT (audio_encoder codes 17% different, audio_tokenizer 5.6e-2, decoder 5.5e-3 relative); forced to f32 they
  match ORT to <= 5.5e-5 relative (most exactly). `OvPart` forces f32 and reads it back from the compiled model;
  `inference_precision="bf16"` opts in (4b int4 IR decode step: no faster, 86 vs 82 ms).
- The CPU plugin computes int64 tensors as int32: the stateful codec's `end` = 2**62 ("length unknown") wrapped
  and gave garbage audio (max|d| 5.3) until `OvPart` saturated int64 feeds to the int32 range.
- Returning outputs as copies (`share_outputs=False`) cost 15-30 ms per 4b decode step (the presents, 38 MB at
  past 128): `OvPart` has each call write into new output tensors it hands over as they are.
- `share_inputs=True` lets a request alias the caller's arrays after the call; a later `share_inputs=False` infer
  on another request of the same compiled model then wrote into them (reproduced on the tiny decoder). `OvPart`
  only lends inputs and detaches them (empty tensors) after every call.
- 4b decoder, 2 threads, one step at past 128 with the past fed from NumPy (benchmarks/openvino_decoder.py,
  quiet machine): ORT CPU on ModelBuilder's int4 graph 68-72 ms; OpenVINO on that ONNX as is 96-108 ms (peak RSS
  6.3 GB: MatMulNBits does not stay packed through the front end); OpenVINO on the int4 IR from `to_ir` (nncf
  INT4_SYM, group 32, from the portable fp32 graph) 82-88 ms, 1.0 GB resident after a 2.9 s compile (peak
  4.5 GB while compiling), 2.05 GB on disk. INT4_ASYM: 98 ms. DYNAMIC_QUANTIZATION_GROUP_SIZE 0 or 128 (default
  32, int8 activations): 92-118 ms, slower.
- `to_ir` calls openvino + nncf directly, not Olive's OpenVINOConversion/OpenVINOWeightCompression (which wrap the
  same two calls): see `OLIVE_NOTE`. From the 14.5 GB portable fp32 4b graph: 26-60 s, peak RSS 11-17 GB (mostly
  the memory-mapped fp32 weights, reclaimable page cache).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .checks import ProviderError, check_finite, check_threads

log = logging.getLogger(__name__)

# OpenVINO element type name -> ONNX Runtime's type string
ORT_TYPES = {"f32": "tensor(float)", "f16": "tensor(float16)", "bf16": "tensor(bfloat16)", "f64": "tensor(double)",
             "i64": "tensor(int64)", "i32": "tensor(int32)", "i8": "tensor(int8)", "u8": "tensor(uint8)",
             "boolean": "tensor(bool)"}
PRECISIONS = ("fp32", "fp16", "int4")
INFERENCE_PRECISIONS = {"f32": "f32", "fp32": "f32", "bf16": "bf16", "f16": "f16", "fp16": "f16"}
RT_KEY = "higgs_onnx"  # the IR's rt_info section holding what the ONNX file said (io names, dim names, metadata)
# weight element types of OpenVINO's low-bit weight compression
COMPRESSED = {"u4", "i4", "nf4", "u8", "i8"}
_SKIP_REPORT = {"Parameter", "Result", "Constant"}  # reported unsupported only along with a real op

_core_lock = threading.Lock()
_core = None


def core():
    """One `openvino.Core` per process (it caches device plugins)."""
    global _core
    with _core_lock:
        if _core is None:
            import openvino as ov
            from openvino.op import _GroupQueryAttentionExtension

            _core = ov.Core()
            # the ONNX front end turns com.microsoft GroupQueryAttention into an OpenVINO op of opset "extension";
            # an IR holding it reads back only with this extension registered
            _core.add_extension(_GroupQueryAttentionExtension())
        return _core


# ---------------------------------------------------------------------------------------------------------------
# reading a graph


@dataclass
class GraphInfo:
    """What ONNX Runtime would show of a graph that OpenVINO loses: declared io names (in order), dim names of
    dynamic axes, and the model's metadata_props."""

    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    dims: dict[str, list] = field(default_factory=dict)  # io name -> [int | dim name | None]
    metadata: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"inputs": self.inputs, "outputs": self.outputs, "dims": self.dims,
                           "metadata": self.metadata})

    @classmethod
    def from_onnx(cls, path: Path) -> GraphInfo:
        import onnx

        m = onnx.load(str(path), load_external_data=False)

        def dims(v):
            return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                    for d in v.type.tensor_type.shape.dim]

        return cls([v.name for v in m.graph.input], [v.name for v in m.graph.output],
                   {v.name: dims(v) for v in (*m.graph.input, *m.graph.output)},
                   {p.key: p.value for p in m.metadata_props})

    @classmethod
    def from_model(cls, model) -> GraphInfo:
        """From the rt_info `to_ir` wrote (empty if the IR came from elsewhere)."""
        if not model.has_rt_info([RT_KEY, "graph"]):
            return cls()
        d = json.loads(model.get_rt_info([RT_KEY, "graph"]).astype(str))
        return cls(d["inputs"], d["outputs"], d["dims"], d["metadata"])


def _onnx_node_names(path: Path) -> dict[str, str]:
    """ONNX output tensor name -> the name of the node producing it (OpenVINO names nodes after their outputs)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    return {o: n.name for n in m.graph.node for o in n.output}


def _unconverted(path: Path) -> list[tuple[str, str]]:
    """(op type, node name) of every ONNX node OpenVINO's front end has no conversion for."""
    from openvino.frontend import FrontEndManager

    # the manager, front end and input model must outlive the converted model: its placeholder nodes refer to the
    # input model's ONNX nodes (with a temporary one, reading their attributes crashed: std::bad_alloc, segfault)
    fem = FrontEndManager()
    fe = fem.load_by_framework("onnx")
    source = fe.load(str(path))
    model = fe.convert_partially(source)
    names = _onnx_node_names(path)
    found = []
    for node in model.get_ordered_ops():
        if "FrameworkNode" not in node.get_type_name():
            continue
        attrs = node.get_attributes()
        op = attrs.get("ONNX_META_type", node.get_type_name())
        domain = attrs.get("ONNX_META_domain", "")
        outs = [n for o in node.outputs() for n in o.get_names()]
        found.append((f"{domain}.{op}" if domain not in ("", "ai.onnx") else op,
                      next((names[o] for o in outs if names.get(o)), node.get_friendly_name())))
    del node, model
    del source, fe, fem
    return found


def _raise_unsupported(name: str, device: str, bad: list[tuple[str, str]]) -> None:
    ops = sorted({op for op, _ in bad})
    raise ProviderError(f"{name}: OpenVINO {device} cannot run {', '.join(ops)} (node {bad[0][1]}"
                        + (f"; {len(bad)} nodes in all)" if len(bad) > 1 else ")"))


def read_model(path: Path, name: str | None = None, device: str = "CPU"):
    """`(ov.Model, GraphInfo)` from an `.onnx` or `.xml`; an op OpenVINO's ONNX front end cannot convert is a
    ProviderError naming the part, the op and a node."""
    name = name or path.stem
    c = core()
    try:
        model = c.read_model(str(path))
    except Exception as e:  # noqa: BLE001 - OpenVINO raises plain RuntimeError for every kind of failure
        if path.suffix == ".onnx" and "wasn't fully converted" in str(e):
            bad = _unconverted(path)
            if bad:
                _raise_unsupported(name, device, bad)
        first = str(e).strip().splitlines()
        raise RuntimeError(f"OpenVINO cannot load {path.name}: {first[-1] if first else e}") from None
    info = GraphInfo.from_onnx(path) if path.suffix == ".onnx" else GraphInfo.from_model(model)
    return model, info


def check_supported(name: str, model, device: str = "CPU") -> None:
    """Every op of `model` must be supported on `device` (`Core.query_model`), else ProviderError."""
    supported = core().query_model(model, device)
    bad = [(n.get_type_name(), n.get_friendly_name()) for n in model.get_ordered_ops()
           if n.get_friendly_name() not in supported]
    real = [b for b in bad if b[0] not in _SKIP_REPORT]
    if real or bad:
        _raise_unsupported(name, device, real or bad)


# ---------------------------------------------------------------------------------------------------------------
# the part


@dataclass(frozen=True)
class IOInfo:
    """ONNX Runtime's NodeArg, as far as this project reads it."""

    name: str
    shape: list
    type: str


@dataclass(frozen=True)
class ModelMeta:
    custom_metadata_map: dict


def io_info(port, name: str, declared: list | None) -> IOInfo:
    dims = []
    for k, d in enumerate(port.get_partial_shape()):
        given = declared[k] if declared and len(declared) == len(port.get_partial_shape()) else None
        if given is not None and given != "":  # what the ONNX file declares, as ONNX Runtime shows it
            dims.append(given)
        else:
            dims.append(d.get_length() if d.is_static else f"{name}_dim_{k}")
    return IOInfo(name, dims, ORT_TYPES.get(port.get_element_type().get_type_name(), "tensor(float)"))


def port_names(ports, declared: list[str]) -> list[str]:
    """The io name of each port: the ONNX-declared name it carries (a port may carry several), else any."""
    want = set(declared)
    return [next((n for n in p.get_names() if n in want), p.any_name) for p in ports]


class OvSession:
    """The slice of `onnxruntime.InferenceSession`'s API the runtime reads, over an OpenVINO compiled model. A
    stateful model's past inputs and present outputs (now its state) are listed as the graph declared them
    (`state_io`), so the manifest's I/O check sees the graph it recorded."""

    def __init__(self, compiled, info: GraphInfo, device: str, state_io: tuple[list, list] = ([], [])):
        self.compiled, self.device = compiled, device
        self.input_names = port_names(compiled.inputs, info.inputs)
        self.output_names = port_names(compiled.outputs, info.outputs)
        self._inputs = [io_info(p, n, info.dims.get(n)) for p, n in zip(compiled.inputs, self.input_names, strict=True)]
        self._outputs = [io_info(p, n, info.dims.get(n)) for p, n in zip(compiled.outputs, self.output_names,
                                                                      strict=True)]
        self._state_io = state_io
        self._meta = ModelMeta(dict(info.metadata))

    def get_inputs(self) -> list[IOInfo]:
        return self._inputs + self._state_io[0]

    def get_outputs(self) -> list[IOInfo]:
        return self._outputs + self._state_io[1]

    def get_modelmeta(self) -> ModelMeta:
        return self._meta

    def get_providers(self) -> list[str]:
        return [f"OpenVINO:{self.device}"]


class OvPart:
    """One part on the OpenVINO runtime: call with keyword inputs; returns {output name: array}. Same interface
    as `session.Part` (NaN/Inf guard included); see the module docstring."""

    def __init__(self, name: str, path: Path, threads: int = 0, device: str = "CPU",
                 inference_precision: str = "f32", stateful: bool = False):
        """`stateful`: hold the decoder's KV cache inside the compiled model (OpenVINO's MakeStateful: every
        `past_key_values.*` input and its `present.*` output become one state of each infer request); run it through
        `new_state()` (see `OvState`), not by calling the part."""
        self.name, self.path, self.device = name, Path(path), device
        threads = check_threads(threads)
        precision = INFERENCE_PRECISIONS.get(inference_precision)
        if precision is None:
            raise ValueError(f"inference_precision must be one of {', '.join(INFERENCE_PRECISIONS)}")
        c = core()
        if device not in c.available_devices:
            raise ProviderError(f"{name}: OpenVINO has no device {device} here (available: "
                                f"{', '.join(c.available_devices) or 'none'})")
        model, info = read_model(self.path, name, device)
        check_supported(name, model, device)
        state_io, self.state_types = ([], []), {}
        if stateful:
            model, state_io, self.state_types = _make_stateful(name, model, info)
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": precision}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        try:
            compiled = c.compile_model(model, device, config)
        except Exception as e:  # noqa: BLE001
            raise ProviderError(f"{name}: OpenVINO {device} cannot compile {self.path.name}: "
                                f"{str(e).strip().splitlines()[-1]}") from None
        ran = list(compiled.get_property("EXECUTION_DEVICES"))
        if ran != [device]:
            raise ProviderError(f"{name}: asked for OpenVINO {device} but the compiled model runs on "
                                f"{', '.join(ran)}")
        got = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        if got != precision:
            raise ProviderError(f"{name}: asked OpenVINO {device} for {precision} inference, it compiled {got}")
        self.compiled, self.inference_precision = compiled, got
        self.session = OvSession(compiled, info, device, state_io)
        self.input_types = {p.name: np.dtype(port.get_element_type().to_dtype())
                            for p, port in zip(self.session.get_inputs(), compiled.inputs, strict=False)}
        self.input_types.update(self.state_types)  # a stateful model's past inputs, as the graph declared them
        self.output_names = list(self.session.output_names)
        self._out_ports = list(compiled.outputs)
        # inputs with a dynamic dim get an empty tensor between calls (fully static ones keep the last array)
        self._blank_inputs = [(port, _empty(port)) for port in compiled.inputs
                              if port.get_partial_shape().is_dynamic]
        self._idle: list = []
        self._lock = threading.Lock()

    @property
    def stateful(self) -> bool:
        return bool(self.state_types)

    def new_state(self, arrays: dict[str, np.ndarray]) -> OvState:
        """An infer request of its own holding `arrays` (past name -> (1, KV heads, L, head dim)) as its state."""
        if not self.stateful:
            raise RuntimeError(f"{self.name} was not compiled stateful")
        state = OvState(self, self.compiled.create_infer_request())
        state.write(arrays)
        return state

    def _request(self):
        with self._lock:
            if self._idle:
                return self._idle.pop()
        req = self.compiled.create_infer_request()
        self._detach(req)
        return req

    def _detach(self, req) -> None:
        """Point the request at tensors of its own: empty inputs (it no longer holds the caller's arrays, which
        `share_inputs` lent it, nor keeps them alive) and new, empty output tensors that the next call's outputs
        are written into and handed over without a copy."""
        for port, blank in self._blank_inputs:
            req.set_tensor(port, blank)
        for port in self._out_ports:
            req.set_tensor(port, _empty(port))

    def __call__(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        unknown = set(feeds) - set(self.input_types)
        if unknown:
            raise KeyError(f"{self.name}: no inputs named {sorted(unknown)} (has {sorted(self.input_types)})")
        missing = set(self.input_types) - set(feeds)
        if missing:  # a pooled request would silently reuse the previous call's tensors
            raise KeyError(f"{self.name}: missing inputs {sorted(missing)}")
        cast = {k: _saturate(np.ascontiguousarray(v, dtype=self.input_types[k])) for k, v in feeds.items()}
        req = self._request()
        try:
            # zero-copy both ways: inputs are lent (share_inputs), outputs are the fresh tensors `_detach` set,
            # returned as arrays that own them (copying the 4b decoder's presents cost up to 15-30 ms a step)
            res = req.infer(cast, share_inputs=True, share_outputs=True)
            outs = {n: res[p] for n, p in zip(self.output_names, self._out_ports, strict=True)}
            del res
        finally:
            self._detach(req)
            with self._lock:
                self._idle.append(req)
        return check_finite(self.name, outs)


class OvState:
    """One request's KV cache held inside a stateful compiled model: its own infer request, whose states are the
    past inputs (each call appends the new positions to them inside the model; nothing crosses to the host but the
    new embeddings in and their hidden states out)."""

    def __init__(self, part: OvPart, request):
        self.part, self.request = part, request
        self.states = {_past_of(s.name, part.state_types): s for s in request.query_state()}

    def infer(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        p = self.part
        cast = {k: _saturate(np.ascontiguousarray(v, dtype=p.input_types[k])) for k, v in feeds.items()}
        res = self.request.infer(cast, share_inputs=False, share_outputs=False)  # small: the new rows only
        return check_finite(p.name, {n: res[port] for n, port in zip(p.output_names, p._out_ports, strict=True)})

    def read(self, length: int | None = None) -> dict[str, np.ndarray]:
        """Copies of the states (the first `length` positions)."""
        return {n: np.array(s.state.data[:, :, :length]) for n, s in self.states.items()}

    def write(self, arrays: dict[str, np.ndarray]) -> None:
        import openvino as ov

        for n, s in self.states.items():
            s.state = ov.Tensor(np.ascontiguousarray(arrays[n], self.part.state_types[n]))


def _past_of(state_name: str, past: dict) -> str:
    """MakeStateful names a state after its pair: "past_key_values.0.key" + "present.0.key"."""
    for n in past:
        if state_name.startswith(n) and state_name[len(n):].startswith("present."):
            return n
    raise RuntimeError(f"state {state_name} pairs with no past input")


def _make_stateful(name: str, model, info: GraphInfo):
    """Turn every past input / present output pair into a state (OpenVINO's MakeStateful transformation); returns
    (model, (the pairs' input IOInfos, output IOInfos) as declared, {past name: dtype})."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    inputs = port_names(model.inputs, info.inputs)
    outputs = port_names(model.outputs, info.outputs)
    past = [(n, p) for n, p in zip(inputs, model.inputs, strict=True) if n.startswith("past_key_values.")]
    present = {n: p for n, p in zip(outputs, model.outputs, strict=True) if n.startswith("present.")}
    pairs = {n: n.replace("past_key_values.", "present.") for n, _ in past}
    if not past or set(pairs.values()) != set(present):
        raise ProviderError(f"{name}: no past_key_values.* / present.* pairs to hold as state")
    state_io = ([io_info(p, n, info.dims.get(n)) for n, p in past],
                [io_info(present[pairs[n]], pairs[n], info.dims.get(pairs[n])) for n, _ in past])
    types = {n: np.dtype(p.get_element_type().to_dtype()) for n, p in past}
    # the transformation finds the ports by tensor name: the ONNX-declared names are among each port's names
    apply_make_stateful_transformation(model, {_any(p, n): _any(present[pairs[n]], pairs[n]) for n, p in past})
    return model, state_io, types


def _any(port, declared: str) -> str:
    return declared if declared in port.get_names() else port.any_name


def _empty(port):
    """A new tensor for `port` with every dynamic dim 0 (its static dims as they are)."""
    import openvino as ov

    return ov.Tensor(port.get_element_type(),
                     ov.Shape([d.get_length() if d.is_static else 0 for d in port.get_partial_shape()]))


def _saturate(a: np.ndarray) -> np.ndarray:
    """int64 values clipped to the int32 range: the CPU plugin computes int64 tensors as int32 and would wrap
    them (measured: the stateful codec's `end` = 2**62, "length not known yet", became garbage audio, max|d| 5.3);
    a saturated sentinel keeps its meaning."""
    if a.dtype == np.int64 and a.size and (a.max() > I32.max or a.min() < I32.min):
        return np.clip(a, I32.min, I32.max)
    return a


I32 = np.iinfo(np.int32)
