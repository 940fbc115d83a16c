"""Execution providers: the one table of everything that differs between devices. Torch-free and import-light.

Every EP-specific choice in the toolkit reads this table: which runtime runs the parts (ONNX Runtime or the
OpenVINO runtime), the ORT provider name, the `execution_provider` ModelBuilder builds the decoder for, which
decoder graphs and precisions build for the device, where IOBinding allocates the KV cache, which exports the
provider can run, and whether this project verified it on a real device. Adding a provider = one entry here (and
its tests); no other module compares EP names (a test scans the sources for that).

Decoder graphs ("attention"):
- "gqa": ModelBuilder's graph with com.microsoft GroupQueryAttention; the KV cache is one shared buffer per layer
  that the op writes in place ("shared-buffer" layout, bound as both past and present).
- "portable": standard ONNX ops only (opset 17; at int4 the weights are MatMulNBits); the cache grows by Concat
  ("concat" layout: present = past + the new rows). For EPs whose contrib attention is missing or broken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERIFIED = "verified here"
BUILT_ONLY = "built, not run here"

HOST_MEMORY = "cpu"  # the OrtValue device of host memory: KV buffers there are NumPy arrays, wrapped without a copy
ATTENTIONS = ("gqa", "portable")
CACHE_LAYOUT = {"gqa": "shared-buffer", "portable": "concat"}

# Ops that an accelerator EP may leave on the CPU by design (shape arithmetic on small int64 tensors); any other
# node assigned to the CPU EP is a fallback, and a fallback is an error. Transpose: the codec encoder's padding
# reverses its int64 `pads` pairs with one (torch's F.pad export), which the CUDA EP leaves on the host (seen on an
# H200, ORT 1.31.1); a float Transpose has a CUDA kernel and never falls back.
SHAPE_OPS = frozenset({"Shape", "Size", "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Range",
                       "ConstantOfShape", "Reshape", "Equal", "Where", "Add", "Sub", "Mul", "Div", "ReduceSum",
                       "CumSum", "Expand", "Less", "Greater", "Not", "And", "Or", "Max", "Min", "Identity",
                       "Transpose"})


@dataclass(frozen=True)
class Provider:
    name: str  # what --device / --provider take
    runtime: str  # "onnxruntime" or "openvino" (the OpenVINO runtime on OpenVINO IR / ONNX)
    ort_name: str | None  # the ONNX Runtime EP name; None when ONNX Runtime does not run the parts
    builder_ep: str  # ModelBuilder's execution_provider for the gqa decoder; parts built on the CPU otherwise
    precisions: dict[str, tuple[str, ...]]  # decoder graph ("attention") -> decoder precisions that build for it
    memory: str  # where IOBinding allocates the KV cache and the step output ("cpu": NumPy-backed, zero-copy)
    offset_binding: bool  # a buffer can be bound at a byte offset (the one-slot views of a batching pool)
    runs: tuple[str, ...]  # export devices whose folders this provider runs
    status: str  # VERIFIED or BUILT_ONLY on this project's machines
    install: str  # what brings the provider into the environment
    int4_accuracy: int = 0  # default MatMulNBits accuracy level (4 = int8 activations, VNNI kernels on the CPU EP)
    ov_device: str | None = None  # OpenVINO device name when runtime == "openvino"
    host_parts: tuple[str, ...] = field(default=())  # parts that run on the CPU beside it, by design
    int8_kv_cache: bool = False  # its GroupQueryAttention keeps a quantized (int8) cache (measured: the CPU EP)
    int8_gemm_route: bool = False  # an int4 gqa decoder may get the int8 GEMM route for many rows (parts/llm_route)
    # ONNX Runtime provider options every session of it gets (cuda: no TF32, so fp32 parts compute in fp32: measured on
    # an H200 with TF32 on, fp32 parts missed their 1e-4 parity by 30-200 x)
    ort_options: tuple[tuple[str, str], ...] = ()
    # its GroupQueryAttention refuses the q/k norms a `-e cuda` build fuses into it: the graphs of another device's
    # export that it runs (`runs`) get them split out first (runtime/cpu_graph.py, a copy in the user's cache)
    splits_qk_norm: bool = False

    @property
    def attentions(self) -> tuple[str, ...]:
        return tuple(self.precisions)

    @property
    def default_attention(self) -> str:
        return next(iter(self.precisions))

    @property
    def all_precisions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for ps in self.precisions.values() for p in ps))

    @property
    def ir(self) -> bool:
        """The decoder is stored as OpenVINO IR (.xml/.bin) with OpenVINO's own weight compression."""
        return self.runtime == "openvino"

    def check(self, precision: str, attention: str | None = None) -> str:
        """The decoder graph for `precision` (and `attention`, default: this provider's); ValueError if it
        cannot be built here."""
        attention = attention or self.default_attention
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
        if attention not in self.precisions:
            raise ValueError(f"--attention {attention} does not build for --device {self.name} (it builds: "
                             f"{', '.join(self.attentions)})")
        if precision not in self.precisions[attention]:
            combos = "; ".join(f"{a}: {', '.join(ps)}" for a, ps in self.precisions.items())
            raise ValueError(f"--device {self.name} --precision {precision} cannot work with the {attention} decoder "
                             f"(valid precisions on {self.name}: {combos})")
        return attention


PROVIDERS: dict[str, Provider] = {p.name: p for p in (
    # fp16 on cpu builds but ModelBuilder's fp16 decode step fails on the CPU EP (toolchain §2.4). It runs cuda
    # exports too (float16 activations, their fused q/k norms split out: docs/devices.md)
    Provider("cpu", "onnxruntime", "CPUExecutionProvider", "cpu",
             {"gqa": ("int4", "fp32"), "portable": ("int4", "fp16", "fp32")},
             memory="cpu", offset_binding=True, runs=("cpu", "cuda"), status=VERIFIED, install="onnxruntime",
             int4_accuracy=4, int8_kv_cache=True, int8_gemm_route=True, splits_qk_norm=True),
    Provider("cuda", "onnxruntime", "CUDAExecutionProvider", "cuda",
             {"gqa": ("int4", "fp16", "fp32"), "portable": ("int4", "fp16", "fp32")},
             memory="cuda", offset_binding=True, runs=("cuda",), status=BUILT_ONLY,
             install="onnxruntime-gpu (same version as onnxruntime, replacing it)", ort_options=(("use_tf32", "0"),)),
    Provider("dml", "onnxruntime", "DmlExecutionProvider", "dml",
             {"gqa": ("int4", "fp16"), "portable": ("int4", "fp32")},
             memory="dml", offset_binding=False, runs=("dml",), status=BUILT_ONLY,
             install="onnxruntime-directml (Windows; replacing onnxruntime)"),
    # The OpenVINO runtime itself: the onnxruntime-ep-openvino plugin offers no device on a non-Intel CPU and
    # onnxruntime-openvino pins an older ORT in place of ours (README, "OpenVINO"). It also runs cpu exports
    # (its ONNX front end reads ModelBuilder's contrib ops), slower at int4 than an openvino export.
    Provider("openvino", "openvino", None, "cpu",
             {"portable": ("int4", "fp16", "fp32")},
             memory="cpu", offset_binding=False, runs=("openvino", "cpu"), status=VERIFIED,
             install="openvino (requirements.txt)", ov_device="CPU"),
)}

# Parts other than the decoder do not depend on the device: they are built once, on the CPU, for every target.
BUILD_PROVIDER = PROVIDERS["cpu"]


def get(name: str) -> Provider:
    try:
        return PROVIDERS[name]
    except KeyError:
        raise ValueError(f"unknown device/provider {name!r}; choose one of {', '.join(PROVIDERS)}") from None


def runners(device: str) -> tuple[str, ...]:
    """The providers that can run an export built for `device`."""
    return tuple(p.name for p in PROVIDERS.values() if device in p.runs)


def matrix() -> list[tuple[str, str, str, str]]:
    """(device, decoder graph, precision, status) rows for the README's device x precision matrix."""
    return [(p.name, a, prec, p.status) for p in PROVIDERS.values() for a, ps in p.precisions.items() for prec in ps]
