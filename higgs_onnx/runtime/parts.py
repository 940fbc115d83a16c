"""An export folder opened for running: the manifest checked, the tokenizer and model facts read, and the parts'
sessions made on first use, each checked against what the manifest recorded.

    parts = ModelParts("onnx/cpu_int4")              # manifest (+ file hashes), provider, facts, tokenizer
    parts.part("llm_decoder")                       # the session, made once (thread-safe), I/O checked
    parts.ran_on()                                  # {part: the provider/device its session runs on}
    parts.unload()                                  # every session let go (an idle server's memory back)

`HiggsTTS` (runtime.model) composes this with the backend (runtime.backend), the codec (runtime.codec) and the
voices (runtime.voice); nothing here generates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time

import numpy as np

from .. import hub, providers
from ..checkpoint import ModelFacts
from ..exports import load_export
from ..foreign import lacks
from ..generation.prompt import PromptTokens
from ..manifest import Manifest, ManifestError
from ..part_facts import FACTS
from .checks import check_threads
from .cpu_graph import default_provider, graph_for
from .prepared import PREPARED_PARTS, enabled, open_prepared
from .session import Part, open_part

STATEFUL_CODEC = "audio_tokenizer_stream"
GENERATION_PARTS = ("llm_decoder", "text_embed", "audio_embed", "audio_heads")  # what every request runs through
VOICE_PARTS = ("llm_decoder", "text_embed", "audio_embed", "audio_encoder")  # what a saved voice's state depends on
log = logging.getLogger(__name__)


class ModelParts:
    """One exported model folder: its manifest, model facts, tokenizer and the parts' sessions (made on first use).

    `provider`: the runtime to run on (None: the device the folder was built for; refused if it cannot run the
    export). `threads`: intra-op threads per session (0: ONNX Runtime's default). `verify`: check every file's
    sha256 against the manifest at load."""

    def __init__(self, model_path: str | os.PathLike, provider: str | None = None, threads: int = 0,
                 verify: bool = True):
        from tokenizers import Tokenizer

        enabled()  # $HIGGS_PREPARED checked before anything, not at the first session it is for (runtime/prepared.py)
        model_path, self.source = hub.local(model_path)  # hf://...: fetched once (docs/hub.md); source: its commit
        check_threads(threads)  # before the (slow) hashing of the model files
        self.manifest: Manifest = load_export(model_path, verify=verify)
        say_lacks(self.manifest)
        built_for = self.manifest.device
        self.provider = provider or default_provider(self.manifest)  # cpu for a cuda folder without CUDA
        if self.provider not in providers.runners(built_for):
            raise ValueError(f"{model_path} was built for {self.manifest.execution_provider} "
                             f"(device {built_for}); run it with --provider {built_for}, or build a "
                             f"{self.provider} export: python optimize.py --device {self.provider} ...")
        folder = self.manifest.folder
        if providers.get(self.provider).ort_name is None and self.manifest.kv_cache != "fp32":
            # OpenVINO's GroupQueryAttention ignores the quantized-cache attributes: measured, 16 % of the codes
            raise ValueError(f"{model_path} holds an {self.manifest.kv_cache} KV cache (ONNX Runtime's quantized "
                             f"GroupQueryAttention), which the OpenVINO runtime does not compute right; run it with "
                             f"--provider {built_for}, or build one for OpenVINO: python optimize.py --device "
                             f"{built_for} --kv-cache fp32 (or --device openvino)")
        try:
            self.facts = ModelFacts.from_dict(self.manifest.model)
        except ValueError as e:
            raise ManifestError(f"{folder}/manifest.json: {e}") from None
        tok_path = self.manifest.path(self.manifest.tokenizer)
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on unreadable files
            raise ManifestError(f"cannot load the tokenizer {tok_path}: {e}") from None
        self.tokens = PromptTokens.from_tokenizer(self.tokenizer, self.facts.placeholder)  # ids by string
        if self.manifest.tokens != dataclasses.asdict(self.tokens):
            raise ManifestError(f"{folder}: the token ids in manifest.json disagree with {tok_path.name}")
        check_genai_config(self.manifest, self.facts)
        self.threads = threads
        self._sessions: dict[str, Part] = {}
        self._lock = threading.Lock()  # each session is made once, by whichever thread asks first
        self.made_at = 0.0  # time.monotonic() when the last session was made (an idle unload counts from it)
        self.load_s = 0.0  # seconds spent making sessions, every thread
        self._clock = threading.local()  # the same, this thread's (`load_clock`)

    def part(self, name: str, stateful: bool = False) -> Part:
        """The part's session (an ONNX Runtime `Part`, or an OpenVINO `OvPart`), made on first use; its inputs and
        outputs are checked against the manifest and the model facts (`check_io`). `stateful`: the decoder compiled
        with its KV cache as state (the OpenVINO runtime only), a session of its own."""
        key = f"{name} (stateful)" if stateful else name
        part = self._sessions.get(key)  # a local: `unload` may empty the dict from another thread meanwhile
        if part is None:
            with self._lock:
                part = self._sessions.get(key)
                if part is None:
                    t0 = time.perf_counter()
                    part = self._open(name, stateful)
                    self._sessions[key] = part
                    self.made_at = time.monotonic()
                    spent = time.perf_counter() - t0
                    self.load_s += spent
                    self._clock.s = self.load_clock() + spent
        return part

    def _open(self, name: str, stateful: bool) -> Part:
        path = graph_for(self.manifest, name, self.provider)  # a cuda graph's CPU rewrite, cached
        io = self.manifest.parts[name].get("io")  # another layout's names (foreign.py)
        if (name in PREPARED_PARTS and not stateful and not io and self.manifest.precision == "int4"
                and providers.get(self.provider) is providers.BUILD_PROVIDER):
            part = open_prepared(name, path, self.provider, self.threads, self.probe)  # runtime/prepared.py
        else:
            part = open_part(name, path, self.provider, self.threads, stateful)
        check_io(self.manifest, self.facts, name, part)
        return RenamedPart(part, io, self.facts.hop) if io else part

    def load_clock(self) -> float:
        """Seconds this thread has spent making sessions (a call's phases leave out the loads they waited for)."""
        return getattr(self._clock, "s", 0.0)

    def probe(self, part: Part) -> list[np.ndarray]:
        """A decoder graph's outputs on a seeded 4-position prefill and (step graph) one step: what its prepared
        copy must give bit for bit (`runtime.prepared`)."""
        from .decoder import SimpleDecoder

        f, rng = self.facts, np.random.default_rng(0)
        dec = SimpleDecoder(part, f)
        cache = dec.new_cache(8)
        out = [dec.run(cache, (rng.standard_normal((4, f.hidden)) * 0.05).astype(np.float32))]
        if dec.fused:
            out += dec.step(cache, rng.integers(0, f.codebook_size, f.num_codebooks))
        return out

    def loaded(self) -> list[str]:
        """The parts whose sessions exist so far."""
        return sorted(self._sessions)

    def unload(self) -> list[str]:
        """Let go of every session (the manifest, facts and tokenizer stay); returns the names of the parts that
        were loaded (`part` makes each again on its next use). A run in progress keeps its own session until it
        returns."""
        with self._lock:
            names, self._sessions = sorted(self._sessions), {}
        return names

    def ran_on(self) -> dict[str, str]:
        """{part: the provider/device its session runs on} for the parts loaded so far (each was checked at load:
        a part that would fall back to another device is an error, never a silent fallback)."""
        return {n: p.session.get_providers()[0] for n, p in sorted(self._sessions.items())}

    @property
    def has_stateful_codec(self) -> bool:
        """Whether the export has the stateful streaming codec (folders built before it decode windows)."""
        return STATEFUL_CODEC in self.manifest.parts

    @property
    def decoder_cache(self) -> str:
        """The decoder graph's KV-cache layout from the manifest ("shared-buffer" or "concat")."""
        return self.manifest.decoder["cache"]

    @property
    def model_id(self) -> str:
        """Identity of the parts a voice state depends on (hashes from the manifest)."""
        parts = self.manifest.parts
        hashes = [parts[p]["files"][parts[p]["file"]]["sha256"] for p in VOICE_PARTS]
        return hashlib.sha256("".join(hashes).encode()).hexdigest()


_SAID: set[str] = set()


def say_lacks(manifest: Manifest) -> None:
    """Say once per folder (per process), in one line, what an export in another layout lacks (foreign.py)."""
    line = lacks(manifest)
    if line and str(manifest.folder) not in _SAID:
        _SAID.add(str(manifest.folder))
        log.warning("%s", line)


class RenamedPart:
    """A part of another layout under our I/O names (`io`: {"inputs": {ours: theirs}, "outputs": {...},
    "input_rank"}): an encoder that takes [B, 1, T] gets our [B, T] padded with zeros to a multiple of the hop."""

    def __init__(self, part: Part, io: dict, hop: int):
        self.part, self.name, self.session = part, part.name, part.session
        self.ins, self.outs = io["inputs"], {v: k for k, v in io["outputs"].items()}
        self.rank, self.hop = io.get("input_rank"), hop
        self.input_types = {k: part.input_types[v] for k, v in self.ins.items()}
        self.output_names = [self.outs.get(n, n) for n in part.output_names]

    def as_fed(self, wav: np.ndarray) -> np.ndarray:
        """(B, T) samples as this encoder's graph gets them: padded with zeros to a multiple of the hop (what it was
        exported for)."""
        return np.pad(wav, ((0, 0), (0, -wav.shape[-1] % self.hop))) if self.rank == 3 else wav

    def __call__(self, **feeds: np.ndarray) -> dict[str, np.ndarray]:
        if self.rank == 3:  # (B, T) -> (B, 1, T')
            (k, wav), = feeds.items()
            feeds = {k: self.as_fed(wav)[:, None, :]}
        out = self.part(**{self.ins.get(k, k): v for k, v in feeds.items()})
        return {self.outs.get(k, k): v for k, v in out.items()}


def check_genai_config(manifest: Manifest, facts: ModelFacts) -> None:
    """ModelBuilder's genai_config.json must exist and agree with the model facts (head size, KV heads)."""
    path = manifest.path(manifest.genai_config)
    try:
        dec = json.loads(path.read_text())["model"]["decoder"]
        ok = (dec["head_size"], dec["num_key_value_heads"]) == (facts.head_dim, facts.kv_heads)
    except (OSError, ValueError, KeyError, TypeError):
        raise ManifestError(f"{path} is missing or malformed (rebuild with optimize.py --force)") from None
    if not ok:
        raise ManifestError(f"{path}: head size / KV heads disagree with the manifest's model facts")


def check_io(manifest: Manifest, facts: ModelFacts, name: str, part: Part) -> None:
    """The session's I/O must be what the manifest recorded and fit the model facts (readable diff if not)."""
    entry = manifest.parts[name]
    recorded = {x["name"] for x in entry["inputs"]}, {x["name"] for x in entry["outputs"]}
    actual = {i.name for i in part.session.get_inputs()}, {o.name for o in part.session.get_outputs()}
    if recorded != actual:
        raise ManifestError(f"{name}: the graph's inputs/outputs {sorted(actual[0])} -> {sorted(actual[1])} differ "
                            f"from the manifest's {sorted(recorded[0])} -> {sorted(recorded[1])}")
    sized = FACTS[name].sized if name in FACTS else None  # the part's own facts (parts/__init__.py)
    if sized:
        io, axis, field = sized
        names = entry.get("io", {})  # another layout's names for ours (foreign.py)
        io = names.get("inputs", {}).get(io) or names.get("outputs", {}).get(io) or io
        size = getattr(facts, field)
        shapes = {x.name: x.shape for x in part.session.get_inputs() + part.session.get_outputs()}
        dim = shapes[io][axis]
        if isinstance(dim, int) and dim != size:
            raise ManifestError(f"{name}: {io} has size {dim} on axis {axis}; the manifest's model facts say "
                                f"{size}")
