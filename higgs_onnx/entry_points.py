"""The console scripts an install gives (pyproject.toml, [project.scripts]): each runs the same main() as its
command in a checkout.

    higgs-onnx-speak    inference.py          higgs-onnx-serve    python -m higgs_onnx.serve
    higgs-onnx-build    optimize.py           higgs-onnx-wyoming  python -m higgs_onnx.wyoming
    higgs-onnx-eval     eval.py               higgs-onnx-corpus   python -m higgs_onnx.corpus

The top-level scripts live beside the package in a checkout; a wheel carries them inside it as `higgs_onnx._scripts`
(pyproject.toml's package-dir), so `script` finds them in either place. A command whose extra is not installed says
so in one line and exits 2 (`extras`); its --help works without the extra (higgs-onnx-build's from optimize.py's
docstring, its options once the extra is installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from .extras import MissingExtra, installed_or_exit, missing

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
    if asks_help(sys.argv[1:]) and missing("export"):  # the options' defaults come from modules that need torch
        return script_help("optimize", "higgs-onnx-build", "export")
    with installed_or_exit("export", "building an export"):
        module = script("optimize")
    return module.main()


def asks_help(argv: list[str]) -> bool:
    """Whether argparse would print the help for `argv` (-h or --help before a `--`)."""
    args = argv[:argv.index("--")] if "--" in argv else argv
    return any(a in ("-h", "--help") for a in args)


def script_help(name: str, prog: str, extra: str) -> int:
    """The help a script's parser cannot give without `extra`: its docstring (read, not run) and one line naming the
    extra that lists every option. Exit 0, as --help is."""
    import ast

    spec = importlib.util.find_spec(f"{SCRIPTS}.{name}") if importlib.util.find_spec(SCRIPTS) else None
    path = Path(spec.origin) if spec and spec.origin else CHECKOUT / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    print(f"usage: {prog} [options]\n\n{doc.replace(f'python {name}.py', prog)}\n\n"
          f"{MissingExtra(extra, f'Listing every option ({prog} --help)', missing(extra))}")
    return 0


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
