"""The console scripts an install gives (pyproject.toml, [project.scripts]): each runs the same main() as its
command in a checkout.

    higgs-onnx-speak    inference.py          higgs-onnx-serve    python -m higgs_onnx.serve
    higgs-onnx-build    optimize.py           higgs-onnx-wyoming  python -m higgs_onnx.wyoming
    higgs-onnx-eval     eval.py               higgs-onnx-corpus   python -m higgs_onnx.corpus

The top-level scripts live beside the package in a checkout; a wheel carries them inside it as `higgs_onnx._scripts`
(pyproject.toml's package-dir), so `script` finds them in either place. A command whose extra is not installed says
so in one line and exits 2 (`extras`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .extras import installed_or_exit

SCRIPTS = f"{__package__}._scripts"
CHECKOUT = Path(__file__).resolve().parent.parent  # where a checkout keeps inference.py, eval.py, optimize.py


def script(name: str) -> ModuleType:
    """The top-level script `name` (inference, eval, optimize, user_script) as a module: the installed copy, else the
    checkout's file."""
    qualified = f"{SCRIPTS}.{name}"
    try:
        return importlib.import_module(qualified)
    except ModuleNotFoundError as e:
        if e.name not in (SCRIPTS, qualified):
            raise  # the script itself imports something missing
    if qualified in sys.modules:
        return sys.modules[qualified]
    path = CHECKOUT / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{name}.py is neither installed ({qualified}) nor in {CHECKOUT}: reinstall higgs-onnx")
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[qualified]
        raise
    return module


def speak() -> int:
    return script("inference").main()


def build() -> int:
    with installed_or_exit("export", "building an export"):
        module = script("optimize")
    return module.main()


def evaluate() -> int:
    return script("eval").main()


def serve() -> int:
    from .serve.__main__ import main

    return main()


def wyoming() -> int:
    from .wyoming import main

    return main()


def corpus() -> int:
    from .corpus import main

    return main()
