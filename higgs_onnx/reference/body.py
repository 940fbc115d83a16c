"""The reference's Qwen3 body: transformers' `Qwen3Model` with the checkpoint's `body.*` tensors (spec §2.1 mapping).

Two ways to hold it, same numbers (a test checks they are bit-identical):
- resident: every layer loaded once (small checkpoints; fastest for step-by-step generation);
- streamed: the layers stay on the meta device and a forward pre-hook reads each layer's tensors from the
  safetensors file just before it runs, a forward hook drops them after. RAM holds one layer at a time: ~0.2 GB
  in bf16 for the 4B geometry instead of 7.3 GB, which is what lets optimize.py and eval.py stay under 8 GB
  next to a 3 GB int4 decoder session. Each forward re-reads the body (from the page cache once warm).
Tensors are read with `pread` into freshly allocated tensors, not through a memory map, so the file's pages never
count towards this process's resident set.
A `patch(layer, state)` callback may replace a layer's tensors as they are loaded (the int4 check uses it to put
the export's dequantized weights in).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import QWEN3_NAME_MAP, TEXT_EMBED, WEIGHTS, TensorFile, load_json, qwen3_config
from ..memory import trim_heap

ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# A body larger than this (in the reference dtype) is streamed layer by layer: the 4B body is 7.3 GB in bf16,
# more than the 8 GB whole-run budget leaves beside the decoder session; the tiny preset is 0.3 MB.
RESIDENT_LIMIT_BYTES = 1 << 30
Patch = Callable[[int, dict[str, torch.Tensor]], None]


def read_tensor(tf: TensorFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of a safetensors file, read with pread (no mmap), converted to `dtype`."""
    meta = tf.header[name]
    begin, end = meta["data_offsets"]
    t = torch.empty(meta["shape"], dtype=ST_DTYPES[meta["dtype"]])
    buf = t.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes: one copy, file -> tensor
    with open(tf.path, "rb") as f:
        got = os.preadv(f.fileno(), [buf], tf.data_start + begin)
    if got != end - begin:
        raise OSError(f"{tf.path}: short read of {name} ({got} of {end - begin} bytes)")
    return t.to(dtype)


def body_names(header: dict) -> dict[str, str]:
    """Qwen3Model parameter name (without `model.`) -> checkpoint tensor name, text embedding excluded."""
    out = {}
    for name in header:
        for old, new in QWEN3_NAME_MAP:
            if name.startswith(old) and name != TEXT_EMBED:
                out[new.removeprefix("model.") + name[len(old):]] = name
    return out


def body_bytes(folder: Path, dtype: torch.dtype) -> int:
    """Size of the body's tensors in `dtype`."""
    tf = TensorFile(folder / WEIGHTS)
    numel = sum(torch.Size(tf.header[n]["shape"]).numel() for n in body_names(tf.header).values())
    return numel * torch.tensor([], dtype=dtype).element_size()


class _Layers:
    """Reads the tensors of layer i (as `Qwen3DecoderLayer` state) and loads / drops them."""

    def __init__(self, folder: Path, dtype: torch.dtype, patch: Patch | None):
        self.tf, self.dtype, self.patch = TensorFile(folder / WEIGHTS), dtype, patch
        self.names: dict[int, dict[str, str]] = {}
        for ours, theirs in body_names(self.tf.header).items():
            if ours.startswith("layers."):
                _, i, rest = ours.split(".", 2)
                self.names.setdefault(int(i), {})[rest] = theirs

    def state(self, i: int) -> dict[str, torch.Tensor]:
        state = {k: read_tensor(self.tf, v, self.dtype) for k, v in self.names[i].items()}
        if self.patch:
            self.patch(i, state)
        return state

    def load(self, layer: torch.nn.Module, i: int) -> None:
        missing, unexpected = layer.load_state_dict(self.state(i), strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"layer {i} tensors do not match config.json: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")


@torch.no_grad()
def forward(body: torch.nn.Module, embeds, dtype: torch.dtype):
    """(S, D) float32 input embeddings (NumPy) -> (S, D) float32 last hidden states (after the final norm)."""
    import numpy as np

    x = torch.from_numpy(np.ascontiguousarray(embeds, np.float32))[None].to(dtype)
    return body(inputs_embeds=x).last_hidden_state[0].float().numpy()


def _drop(layer: torch.nn.Module, args, out) -> None:
    layer.to_empty(device="meta")  # frees the layer's tensors; returns None so the output is kept
    trim_heap()  # and gives their pages back now, not at the next layer's allocation


def load_body(folder: Path, dtype: torch.dtype, stream: bool | None = None, patch: Patch | None = None):
    """`Qwen3Model` in `dtype`; its `embed_tokens` stays on the meta device (the reference feeds `inputs_embeds`).

    `stream=None` streams when the body is larger than `RESIDENT_LIMIT_BYTES`."""
    from transformers import Qwen3Config, Qwen3Model

    tc = qwen3_config(load_json(folder / "config.json"))
    with torch.device("meta"):
        body = Qwen3Model(Qwen3Config(**{k: v for k, v in tc.items() if k != "dtype"}))
    layers = _Layers(folder, dtype, patch)
    if sorted(layers.names) != list(range(len(body.layers))):
        raise ValueError(f"checkpoint has layers {sorted(layers.names)[:5]}..., config.json {len(body.layers)}")
    norm = {k.removeprefix("norm."): read_tensor(layers.tf, v, dtype)
            for k, v in body_names(layers.tf.header).items() if k.startswith("norm.")}
    body.norm.load_state_dict(norm, assign=True)
    body.rotary_emb = type(body.rotary_emb)(config=body.config)  # meta-built buffers (inv_freq) made real
    if stream is None:
        stream = body_bytes(folder, dtype) > RESIDENT_LIMIT_BYTES
    for i, layer in enumerate(body.layers):
        if stream:
            layer.register_forward_pre_hook(lambda mod, args, i=i: layers.load(mod, i))
            layer.register_forward_hook(_drop)
        else:
            layers.load(layer, i)
    body.streamed = stream
    return body.eval()
