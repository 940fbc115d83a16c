"""Which route a decoder call takes: the int4 step graph or its int8 GEMM twin (`parts/llm_route.py`).

    policy = RoutePolicy(prefill=16, batch=4)   # from the export's measured crossovers (manifest decoder.route)
    policy.use(rows=281, batched=False)         # True: a one-row call of 281 positions goes to the route
    policy.use(rows=2, batched=True)            # False: a step of 2 rows stays on int4

The choice depends only on the call's shape (positions of a one-row call, rows of a batched step), so a request
makes the same calls, and the same bytes, alone or beside others whenever its calls have the same shapes: a
deterministic job runs alone, where its prefill is one call and its steps are single rows, as made alone.

`HiggsTTS(route=...)`: "auto" (the export's crossovers, where this CPU's int8 GEMM multiplies the route's weight
form exactly: s7 on any x86 CPU with AVX2, s8 only with VNNI or AMX; `manifest.ROUTE_FORMS`), "off" (int4 for
every call; the route's session is never loaded), "on" (every call of two or more rows on the route: comparisons
and benchmarks); None (the default): `$HIGGS_ROUTE`, else "auto", so a server or a corpus run can be switched
without a flag of its own.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from ..manifest import ROUTE_KIND, route_form

log = logging.getLogger(__name__)

MODES = ("auto", "off", "on")
# x86 flags of an int8 dot product that MLAS's u8s8 GEMM uses without saturating 16-bit pair sums (without them it
# falls back to vpmaddubsw, whose pairs of 255 x 127 saturate: ONNX Runtime's quantization docs)
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# per weight form, the flags (any one) with which the GEMM's int32 result is exact: s7's pairs (255 x 63 x 2 = 32130)
# fit vpmaddubsw's 16 bits, so AVX2's kernel is exact too (every x86 CPU with VNNI or AMX also has AVX2)
FORM_NEEDS = {"s7": ("avx2",), "s8": INT8_DOT_FLAGS}


@dataclass(frozen=True)
class RoutePolicy:
    """Calls of at least `prefill` positions (one row) or `batch` rows (a batched step) go to the route; None: never."""

    prefill: int | None = None
    batch: int | None = None

    def use(self, rows: int, batched: bool) -> bool:
        limit = self.batch if batched else self.prefill
        return limit is not None and rows >= limit

    @property
    def active(self) -> bool:
        return self.prefill is not None or self.batch is not None


NEVER = RoutePolicy()
ALWAYS = RoutePolicy(prefill=1, batch=1)
MULTI_ROW = RoutePolicy(prefill=2, batch=2)


@contextmanager
def forced(decoder, policy: RoutePolicy):
    """`decoder` (a `BoundDecoder` with its route) under `policy` for the block, its own policy back afterwards:
    the gate, the crossover's timing and eval compare the two routes on the same calls."""
    saved = decoder.policy
    decoder.policy = policy
    try:
        yield decoder
    finally:
        decoder.policy = saved


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runs_exactly(form: str, flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` multiplies the route's `form` of weights exactly (`FORM_NEEDS`). Where flags
    cannot be read (not Linux; an Arm CPU, whose /proc/cpuinfo says "Features") the export's measurement stands."""
    return not flags or any(f in flags for f in FORM_NEEDS[form])


ENV = "HIGGS_ROUTE"  # the default mode of every HiggsTTS made without one (servers, corpus workers, benchmarks)


def check_mode(mode) -> str:
    """`mode` checked; None: `$HIGGS_ROUTE`, else "auto"."""
    if mode is None:
        env = os.environ.get(ENV, "").strip()
        if env and env not in MODES:
            raise ValueError(f"${ENV} must be one of {', '.join(MODES)}, got {env!r}")
        return env or "auto"
    if mode not in MODES:
        raise ValueError(f"route must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def policy(route: dict | None, mode: str = "auto", flags: frozenset[str] | None = None) -> RoutePolicy:
    """The policy for an export's `decoder.route` manifest entry (None: no route) under `mode`, on a CPU with
    `flags` (None: this one's, `cpu_flags`)."""
    check_mode(mode)
    if mode == "off" or route is None or route["kind"] != ROUTE_KIND:  # the entry was checked at load (manifest)
        return NEVER
    if mode == "on":
        return MULTI_ROW
    form = route_form(route)
    if not runs_exactly(form, cpu_flags() if flags is None else flags):
        log.warning("int8 route off: its %s weights need %s, this CPU has none (its u8s8 GEMM could saturate); every "
                    "call runs on int4%s", form, " or ".join(FORM_NEEDS[form]),
                    "; optimize.py --route-form s7 builds a route exact on every x86 CPU with AVX2" if form != "s7"
                    else "")
        return NEVER
    cross = route["crossover"]
    return RoutePolicy(prefill=cross["prefill"], batch=cross["batch"])


# the route loads only where this much of its size is free besides it (ONNX Runtime packs the weights it loads)
HEADROOM = 1.5


def fits(nbytes: int) -> bool:
    """Whether loading `nbytes` more leaves the machine room (available memory >= HEADROOM x it); where it does not,
    one warning line, and every call runs on int4 (the route is a speed-up, never a reason to run out of memory)."""
    import psutil

    free = psutil.virtual_memory().available
    if free >= HEADROOM * nbytes:
        return True
    log.warning("int8 route off: it needs %.1f GB more memory, %.1f GB is available; every call runs on int4 "
                "(HIGGS_ROUTE=off says so without this check)", nbytes / 1e9, free / 1e9)
    return False


SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")  # the ones that decide the kernels' speed


def cpu_summary() -> dict:
    """This CPU's model name and the SIMD / matrix flags that decide the int4 and int8 kernels (Linux)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    flags = cpu_flags()
    return {"model": model, "flags": [f for f in SIMD_FLAGS if f in flags] + sorted(f for f in flags
                                                                                   if f.startswith("amx_"))}
