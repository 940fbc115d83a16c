"""Shared fixtures: one tiny synthetic checkpoint per test session, and its PyTorch reference."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("CI", "1")  # Olive's telemetry hangs at exit without it (toolchain G3)
# The suite runs two workers on two cores (make test: pytest -n 2): a decoder session's spinning intra-op threads
# would burn the other worker's core (measured: 24 % less CPU, 13 % less wall time with spinning off). Inherited by
# the CLIs, servers and Ray workers the tests start.
os.environ.setdefault("HIGGS_ORT_SPIN", "0")
# A shell that starts the suite in the background (`cmd &`) ignores SIGINT, and an ignored signal stays ignored in
# every child, so the Ctrl-C tests' children would never see it; a handler here is reset to the default on exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def out_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's export root: every tiny export of the suite is built here, so they share one part cache
    (`<out_root>/.build/parts`: a part is built once per stamp, whichever test asks first)."""
    return tmp_path_factory.mktemp("onnx")


def _session_env(name: str, value: Path):
    """`$name` set to `value` for the session (this process and every process a test starts), then restored."""
    old = os.environ.get(name)
    os.environ[name] = str(value)
    yield value
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@pytest.fixture(scope="session", autouse=True)
def part_cache(out_root: Path) -> Path:
    """One part cache for the session (`$HIGGS_PART_CACHE`, read by every Exporter, in this process and in the
    optimize.py processes tests start): a test that builds an export into a folder of its own reuses the parts
    already built and rebuilds only what it is about."""
    from higgs_onnx.export import PART_CACHE_ENV

    yield from _session_env(PART_CACHE_ENV, out_root / ".build" / "parts")


@pytest.fixture(scope="session", autouse=True)
def user_cache(out_root: Path) -> Path:
    """The user's cache of higgs-onnx (`$HIGGS_CACHE`: derived manifests of community-layout folders, decoder graphs
    rewritten for the CPU provider) in the session's folder, never in the home folder; inherited by subprocesses."""
    from higgs_onnx.user_cache import CACHE_ENV

    yield from _session_env(CACHE_ENV, out_root / ".build" / "user-cache")


@pytest.fixture(scope="session")
def tiny_ckpt(out_root: Path) -> Path:
    """The tiny synthetic checkpoint, where `optimize.py --synthetic tiny --output <out_root>` keeps it: the CLI and
    the make targets that tests run with that output root find it and the parts already built from it."""
    from higgs_onnx.synthetic import build

    return build("tiny", out_root / ".build" / "synthetic_tiny", seed=0, progress=False)


@pytest.fixture(scope="session")
def reference(tiny_ckpt: Path):
    from higgs_onnx.reference.model import ReferenceModel

    return ReferenceModel(tiny_ckpt)


@pytest.fixture(scope="session")
def real_tokenizer():
    from tokenizers import Tokenizer

    from higgs_onnx.tokenizer_files import real_tokenizer_json

    return Tokenizer.from_str(real_tokenizer_json())


@pytest.fixture(scope="session")
def builds(tiny_ckpt: Path, out_root: Path) -> dict[str, Path]:
    """The tiny checkpoint exported at int4 and fp32 for cpu (built once per session). The int4 export's int8 route
    gets a given crossover (`route_crossover`), not one measured on a busy 2-core test machine (tiny timings are
    noise), so every run of the suite sends the same calls to the same route; `tests/test_route.py` times it."""
    from higgs_onnx.export import Exporter, ExportOptions

    return {p: Exporter(str(tiny_ckpt), out_root, ExportOptions(
        "cpu", p, route_crossover=ROUTE_CROSSOVER if p == "int4" else None)).run() for p in ("int4", "fp32")}


# one-row calls of 64 positions and more (a clone's prefix) on the int8 route; batched steps on int4
ROUTE_CROSSOVER = (64, None)


@pytest.fixture(scope="session")
def route_crossover() -> tuple:
    """The crossover `builds` gave its int4 export, for a test that builds it again and must find it up to date (a
    measured one would rebuild it under the other tests of its worker). A fixture: test modules import no conftest."""
    return ROUTE_CROSSOVER


# The loaded models, defined once here: a test module that asks for one loads it once (module scope: a module's
# voices and schedulers never meet another module's). A test that needs a model of its own (a guard, a KV layout,
# the route off) makes it in the test.
@pytest.fixture(scope="module")
def tts(builds):
    """The tiny fp32 export, loaded (exact: the tests that compare bytes use it)."""
    from higgs_onnx.runtime.model import HiggsTTS

    return HiggsTTS(builds["fp32"], verify=False)


@pytest.fixture(scope="module")
def tts4(builds):
    """The tiny int4 export (with its int8 route, at the suite's crossover), loaded."""
    from higgs_onnx.runtime.model import HiggsTTS

    return HiggsTTS(builds["int4"], verify=False)


@pytest.fixture(scope="session")
def openvino_build(builds, tiny_ckpt: Path, out_root: Path) -> Path:
    """The tiny checkpoint exported for the OpenVINO runtime at int4 (`openvino_int4`: an IR decoder; every other
    part comes from the part cache the cpu builds filled)."""
    from higgs_onnx.export import Exporter, ExportOptions

    return Exporter(str(tiny_ckpt), out_root, ExportOptions("openvino", "int4")).run()


# -- the fast tier (`make test-fast`: -m "not slow") must not build an export ---------------------------------------
EXPORT_FIXTURE = "builds"


def _needs_export_unmarked(item: pytest.Item) -> bool:
    """A test that requests `builds`, directly or through other fixtures (`fixturenames` is the transitive
    closure), without being marked slow: it would build both exports inside the fast tier."""
    return EXPORT_FIXTURE in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None


def _guard_message(item: pytest.Item) -> str:
    return (f"{item.nodeid} needs the `{EXPORT_FIXTURE}` fixture (it exports the tiny checkpoint, minutes) but is not "
            f"marked slow: mark it @pytest.mark.slow, or make it not need an export (make test-fast must build none)")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    offenders = [item for item in items if _needs_export_unmarked(item)]
    if offenders and config.option.collectonly:  # `--co` runs no setup: refuse the listing instead
        raise pytest.UsageError("\n".join(_guard_message(item) for item in offenders))


@pytest.hookimpl(tryfirst=True)  # before any fixture is set up, so the export is never started
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _needs_export_unmarked(item):
        pytest.fail(_guard_message(item), pytrace=False)
