"""The optional parts of the install, defined once: which extra (`pip install 'higgs-onnx[EXTRA]'`) gives which
packages, and the one line a command prints when it needs an extra that is not installed.

The base install loads an export and speaks (inference.py, `HiggsTTS`); the rest comes with extras (pyproject.toml
lists their pins; tests/test_packaging.py holds that list and this table equal). A command checks the extra it needs
before it starts (`require`), and an import of an extra's module that fails later (`needs`, or any error reaching
`cli.run_main`) becomes the same line, exit 2, never a traceback:

    higgs-onnx: the server needs extra packages: pip install 'higgs-onnx[server]' (missing: fastapi)

Imports nothing beyond the standard library: it runs where the extras are missing.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

DIST = "higgs-onnx"


@dataclass(frozen=True)
class Extra:
    what: str  # what it gives (docs/install.md's table; the message's subject when a caller names none)
    modules: dict[str, str]  # top-level import name -> the distribution that installs it (pinned in pyproject.toml)
    includes: tuple[str, ...] = ()  # other extras it installs too


EXTRAS: dict[str, Extra] = {
    "export": Extra("building an export (optimize.py) and the PyTorch reference",
                    {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors",
                     "onnxruntime_genai": "onnxruntime-genai", "olive": "olive-ai", "requests": "requests",
                     "onnxscript": "onnxscript", "onnx_ir": "onnx-ir"}),
    "openvino": Extra("the OpenVINO runtime (--provider openvino) and its builds", {"openvino": "openvino",
                                                                                   "nncf": "nncf"}),
    "server": Extra("the server", {"fastapi": "fastapi", "uvicorn": "uvicorn", "websockets": "websockets",
                                   "python_multipart": "python-multipart", "prometheus_client": "prometheus-client",
                                   "av": "av", "wyoming": "wyoming", "zeroconf": "zeroconf"}),
    "text": Extra("the text options (--normalize, --markdown, --emoji, --ssml)",
                  {"num2words": "num2words", "docopt": "docopt", "cn2an": "cn2an", "proces": "proces",
                   "markdown_it": "markdown-it-py", "emoji": "emoji", "defusedxml": "defusedxml"}),
    "asr": Extra("word timing (--caption-level word) and pocketsphinx's recogniser (--asr-model pocketsphinx)",
                 {"pocketsphinx": "pocketsphinx", "sounddevice": "sounddevice", "jiwer": "jiwer"}),
    "loudness": Extra("loudness normalisation (--loudness)", {"pyloudnorm": "pyloudnorm", "scipy": "scipy"}),
    "eval": Extra("the parity report (eval.py): the PyTorch reference, plots, DNSMOS, ASR",
                  {"matplotlib": "matplotlib", "speechmos": "speechmos"}, ("export", "asr")),
    "ray": Extra("Ray (the corpus command, serve --ray)", {"ray": "ray"}, ("server",)),
}
# what each text option imports (the `text` extra holds them all)
TEXT_OPTIONS = {"normalize": ("num2words", "cn2an"), "markdown": ("markdown_it", "emoji"), "emoji": ("emoji",),
                "ssml": ("defusedxml",)}


# a speech job's fields whose work an extra does, and the modules it imports: job/options.py refuses such a field
# by name at every door (a server's request too) when its extra is missing, before any work
FIELD_EXTRAS = {**{name: ("text", modules) for name, modules in TEXT_OPTIONS.items()},
                "caption_level": ("asr", ("pocketsphinx",)), "loudness": ("loudness", ("pyloudnorm",))}


def field_missing(name: str, label: str) -> MissingExtra | None:
    """The MissingExtra of the job field `name` (a value that asks for its work: the caller knows) named `label`, or
    None when its packages are installed or it needs none."""
    if name not in FIELD_EXTRAS:
        return None
    extra, modules = FIELD_EXTRAS[name]
    absent = missing(extra, modules)
    return MissingExtra(extra, label, absent) if absent else None


class MissingExtra(Exception):
    """`what` needs `extra`, whose `missing` distributions are not installed. str(): the one line, without the
    `higgs-onnx: ` a command puts before it (`line`)."""

    def __init__(self, extra: str, what: str, missing: list[str]):
        self.extra, self.what, self.missing = extra, what, missing
        super().__init__(f"{what} needs extra packages: pip install '{DIST}[{extra}]' (missing: {', '.join(missing)})")

    def line(self) -> str:
        return f"{DIST}: {self}"


def modules_of(extra: str) -> dict[str, str]:
    """Import name -> distribution, for the extra and every extra it includes."""
    e = EXTRAS[extra]
    out = dict(e.modules)
    for inner in e.includes:
        out.update(modules_of(inner))
    return out


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The distributions of `extra` (or of just `modules`, import names of it) that are not installed."""
    table = modules_of(extra)
    names = table if modules is None else modules
    return list(dict.fromkeys(table[m] for m in names if importlib.util.find_spec(m) is None))


def require(extra: str, what: str | None = None, modules: tuple[str, ...] | None = None) -> None:
    """MissingExtra unless every package of `extra` (or just `modules` of it) is installed; `what` names the
    command or option that needs it (default: the extra's own description)."""
    absent = missing(extra, modules)
    if absent:
        raise MissingExtra(extra, what or EXTRAS[extra].what, absent)


def require_text(values: dict, flag: str = "--{}") -> None:
    """The text options that are set in `values` (a job's option values by name) and the packages they import.
    `flag` spells an option's name in the message (`--{}` on a command line)."""
    for name, modules in TEXT_OPTIONS.items():
        if values.get(name) not in (None, False):
            require("text", flag.format(name.replace("_", "-")), modules)


def extra_of(module: str) -> str | None:
    """The extra that installs the top-level module `module` (the smallest one that has it)."""
    top = module.split(".")[0]
    for name, e in EXTRAS.items():
        if top in e.modules:
            return name
    return None


def as_missing(error: BaseException, what: str | None = None) -> MissingExtra | None:
    """`error` as a MissingExtra: itself, or a ModuleNotFoundError of a module an extra installs; else None."""
    if isinstance(error, MissingExtra):
        return error
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    extra = extra_of(error.name)
    if extra is None:
        return None
    return MissingExtra(extra, what or EXTRAS[extra].what, [EXTRAS[extra].modules[error.name.split(".")[0]]])


@contextmanager
def needs(extra: str, what: str | None = None) -> Iterator[None]:
    """Checks `extra` first, then turns a ModuleNotFoundError of any extra's module inside the block into a
    MissingExtra (an import that needs a package the table did not list for `extra` is still named)."""
    require(extra, what)
    try:
        yield
    except ModuleNotFoundError as e:
        found = as_missing(e, what)
        if found is None:
            raise
        raise found from None


@contextmanager
def installed_or_exit(extra: str, what: str | None = None) -> Iterator[None]:
    """`needs`, for a script's module-level imports (before `cli.run_main` can catch anything): the one line on
    stderr and exit 2."""
    try:
        with needs(extra, what):
            yield
    except MissingExtra as e:
        print(e.line(), file=sys.stderr)
        raise SystemExit(2) from None
