"""pyproject.toml against requirements.txt (the pinned, tested set) and higgs_onnx.extras (the table commands check),
the console scripts, the files a wheel carries, and the one line a command prints when its extra is missing. Fast:
nothing is installed here (tests/test_install.py installs the package into fresh venvs)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from higgs_onnx import extras
from higgs_onnx.cli import run_main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
SELF = "higgs-onnx"
# what the base install must never pull (directly: the slow test checks what it pulls in a fresh venv)
HEAVY = {"torch", "transformers", "olive-ai", "onnxruntime-genai", "ray", "openvino", "nncf", "playwright", "pytest",
         "matplotlib", "fastapi", "uvicorn", "scipy"}
# requirements.txt packages that belong to no extra on purpose (none today: a pinned dependency of another package
# sits in the extra of the package that needs it, e.g. sounddevice with pocketsphinx in `asr`)
UNDECLARED: set[str] = set()
REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;#]+)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(line: str) -> tuple[str, str, str]:
    """`name[extras]==version` -> (normalised name, sorted extras, version); AssertionError when not pinned."""
    m = REQ.match(line.split("#", 1)[0].strip())
    assert m, f"{line!r} is not pinned as name==version"
    inner = ",".join(sorted(norm(x) for x in (m.group(2) or "[]")[1:-1].split(",") if x.strip()))
    return norm(m.group(1)), inner, m.group(3)


def requirements() -> dict[str, tuple[str, str]]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.split("#", 1)[0].strip():
            name, inner, version = parse(line)
            out[name] = (inner, version)
    return out


def self_refs(specs: list[str]) -> set[str]:
    """The extras `higgs-onnx[a,b]` entries include."""
    out = set()
    for s in specs:
        m = re.fullmatch(r"higgs-onnx\[([a-z,]+)\]", s)
        if m:
            out.update(m.group(1).split(","))
    return out


def pinned(specs: list[str]) -> list[str]:
    return [s for s in specs if not s.startswith(f"{SELF}[")]


EXTRAS = PROJECT["optional-dependencies"]


def test_every_pin_equals_requirements():
    reqs = requirements()
    for where, specs in [("dependencies", PROJECT["dependencies"]), *EXTRAS.items()]:
        for spec in pinned(specs):
            name, inner, version = parse(spec)
            assert name in reqs, f"{where}: {spec} is not in requirements.txt"
            assert reqs[name] == (inner, version), f"{where}: {spec} differs from requirements.txt's pin {reqs[name]}"


def test_every_requirement_is_declared_once():
    declared: dict[str, str] = {}
    for where, specs in [("base", PROJECT["dependencies"]), *EXTRAS.items()]:
        for spec in pinned(specs):
            name = parse(spec)[0]
            assert name not in declared, f"{name} is in both {declared[name]} and {where}"
            declared[name] = where
    missing = set(requirements()) - set(declared) - UNDECLARED
    assert not missing, f"requirements.txt packages in neither the base install nor an extra: {sorted(missing)}"


def test_base_has_nothing_heavy():
    base = {parse(s)[0] for s in PROJECT["dependencies"]}
    assert not base & HEAVY, f"heavy packages in the base install: {sorted(base & HEAVY)}"
    assert {"onnxruntime", "numpy", "tokenizers", "soundfile", "huggingface-hub"} <= base


def test_extras_table_matches_pyproject():
    """higgs_onnx.extras names the same distributions and includes per extra as pyproject.toml (what a command
    checks is what the extra installs); every extra module's distribution is the one pyproject pins."""
    table = {name for name in extras.EXTRAS}
    assert table == set(EXTRAS) - {"all", "dev"}
    for name, extra in extras.EXTRAS.items():
        assert {norm(d) for d in extra.modules.values()} == {parse(s)[0] for s in pinned(EXTRAS[name])}, name
        assert set(extra.includes) == self_refs(EXTRAS[name]), name
    assert self_refs(EXTRAS["all"]) == table
    assert self_refs(EXTRAS["dev"]) == {"all"}


def test_console_scripts_resolve():
    import importlib

    scripts = PROJECT["scripts"]
    assert {"higgs-onnx-speak", "higgs-onnx-build", "higgs-onnx-eval", "higgs-onnx-serve", "higgs-onnx-wyoming",
            "higgs-onnx-corpus"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_entry_point_runs_the_checkout_script(capsys):
    """From a checkout the console script loads the top-level file (a wheel carries it as higgs_onnx._scripts)."""
    from higgs_onnx import entry_points

    mod = entry_points.script("inference")
    assert Path(mod.__file__).resolve() == ROOT / "inference.py"
    assert mod.__name__ == "higgs_onnx._scripts.inference"
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "--model-path" in capsys.readouterr().out


def test_wheel_layout_matches_the_tree():
    """Every package folder is listed, the scripts ride along, every data file the package reads is package data."""
    st = PYPROJECT["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "higgs_onnx").rglob("__init__.py")}
    assert set(st["packages"]) == found | {"higgs_onnx._scripts"}, "pyproject.toml [tool.setuptools] packages"
    assert st["package-dir"] == {"higgs_onnx._scripts": "."}
    for script in ("inference.py", "eval.py", "optimize.py", "user_script.py"):
        assert (ROOT / script).is_file()
    tracked = subprocess.run(["git", "ls-files", "higgs_onnx"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    data = [f for f in tracked if not f.endswith(".py")]
    assert any(f.startswith("higgs_onnx/assets/") for f in data) and any("/static/" in f for f in data)
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]
    for f in data:
        owners = [(pkg, g) for pkg, gs in globs.items() for g in gs
                  if f.startswith(pkg.replace(".", "/") + "/") and
                  Path(f).relative_to(pkg.replace(".", "/")).match(g)]
        assert owners, f"{f} is not package data in pyproject.toml: an installed wheel would lack it"


def test_missing_extra_is_one_line(monkeypatch):
    """An import name the environment lacks (a stand-in added to the server's table) is named by its distribution."""
    monkeypatch.setitem(extras.EXTRAS["server"].modules, "no_such_module_xyz", "no-such-dist")
    with pytest.raises(extras.MissingExtra) as e:
        extras.require("server", "the server", ("no_such_module_xyz",))
    assert e.value.line() == ("higgs-onnx: the server needs extra packages: pip install 'higgs-onnx[server]' "
                              "(missing: no-such-dist)")
    assert e.value.extra == "server" and e.value.missing == ["no-such-dist"]
    extras.require("server", "the server", ("fastapi",))  # installed here: nothing raised


def test_import_error_of_an_extras_module_becomes_the_line():
    err = ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
    found = extras.as_missing(err)
    assert found is not None and found.extra == "server" and found.missing == ["fastapi"]
    assert extras.as_missing(ModuleNotFoundError("x", name="some_unknown_module")) is None
    assert extras.as_missing(ModuleNotFoundError("x", name="pocketsphinx.lm")).extra == "asr"
    assert extras.extra_of("torch") == "export" and extras.extra_of("ray") == "ray"


def test_run_main_turns_a_missing_extra_into_exit_2(capsys):
    import argparse

    ap = argparse.ArgumentParser(prog="t")
    ap.add_argument("--log-level", default="WARNING")

    def fails(_args):
        raise ModuleNotFoundError("No module named 'num2words'", name="num2words")

    assert run_main(fails, ap, []) == 2
    err = capsys.readouterr().err
    assert err == ("higgs-onnx: the text options (--normalize, --markdown, --emoji, --ssml) needs extra packages: "
                   "pip install 'higgs-onnx[text]' (missing: num2words)\n")

    def other(_args):
        raise ModuleNotFoundError("No module named 'nothing_we_know'", name="nothing_we_know")

    assert run_main(other, ap, []) == 1  # not an extra's module: the generic one-line error


def test_run_main_turns_provider_and_cache_errors_into_exit_2(capsys):
    """An execution provider this onnxruntime lacks and a cache that cannot be written are environment errors:
    their own line, exit 2, no "rerun with --log-level DEBUG" tail."""
    import argparse

    from higgs_onnx.runtime.checks import ProviderError
    from higgs_onnx.user_cache import cache_error

    ap = argparse.ArgumentParser(prog="t")
    ap.add_argument("--log-level", default="WARNING")
    line = "llm_step: execution provider CUDAExecutionProvider is not available; install onnxruntime-gpu"
    for error, said in ((ProviderError(line), line), (cache_error("read-only file system: /x"), None)):
        def fails(_args, error=error):
            raise error

        assert run_main(fails, ap, []) == 2
        err = capsys.readouterr().err
        assert err == f"error: {said or error}\n" and "--log-level DEBUG" not in err


# extras' modules made unimportable, as in a base install (tests/test_install.py checks a real one)
BASE_ONLY = """
import importlib.abc, importlib.util, sys
from higgs_onnx.extras import EXTRAS
hidden = {m for e in EXTRAS.values() for m in e.modules}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in hidden:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in hidden else find(name, *a)
fn, sys.argv = sys.argv[1], sys.argv[1:]
from higgs_onnx import entry_points
sys.exit(getattr(entry_points, fn)())
"""


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_console_scripts_help_needs_no_extra(flag):
    """--help (-h) of each console script prints its help and exits 0 where no extra is installed (higgs-onnx-build
    from optimize.py's docstring and the line naming the extra its options need); without it the extra's line."""
    import sys

    for name, target in PROJECT["scripts"].items():
        fn = target.partition(":")[2]
        r = subprocess.run([sys.executable, "-c", BASE_ONLY, fn, flag], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and r.stderr == "", (name, r.returncode, r.stderr[-2000:])
        assert r.stdout.startswith("usage: ") and len(r.stdout.splitlines()) > 5, (name, r.stdout[:500])
        if name == "higgs-onnx-build":
            assert "higgs-onnx-build --synthetic tiny --device cpu --precision int4" in r.stdout
            assert r.stdout.splitlines()[-1].startswith("Listing every option (higgs-onnx-build --help) needs extra "
                                                        "packages: pip install 'higgs-onnx[export]' (missing: torch")
    r = subprocess.run([sys.executable, "-c", BASE_ONLY, "build", "--synthetic", "tiny"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("higgs-onnx: building an export needs extra packages: ")


def test_needs_and_installed_or_exit(capsys):
    with pytest.raises(extras.MissingExtra) as e, extras.needs("text", "--markdown"):
        raise ModuleNotFoundError("No module named 'markdown_it'", name="markdown_it")
    assert str(e.value) == ("--markdown needs extra packages: pip install 'higgs-onnx[text]' (missing: "
                            "markdown-it-py)")
    with pytest.raises(ModuleNotFoundError), extras.needs("text"):  # not an extra's module: raised as it was
        raise ModuleNotFoundError("No module named 'zzz'", name="zzz")
    with pytest.raises(SystemExit) as ex, extras.installed_or_exit("text", "--ssml"):
        raise ModuleNotFoundError("No module named 'defusedxml'", name="defusedxml")
    assert ex.value.code == 2
    assert capsys.readouterr().err.startswith("higgs-onnx: --ssml needs extra packages: pip install 'higgs-onnx[text]'")


def test_text_options_name_their_flag(monkeypatch):
    """require_text asks only for what a set option imports, and names the flag."""
    asked = []
    monkeypatch.setattr(extras, "require", lambda extra, what=None, modules=None: asked.append((extra, what, modules)))
    extras.require_text({"normalize": "en", "markdown": None, "ssml": True, "emoji": None, "lexicon": "x"})
    assert asked == [("text", "--normalize", ("num2words", "cn2an")), ("text", "--ssml", ("defusedxml",))]


def test_install_page_lists_every_extra():
    page = (ROOT / "docs" / "install.md").read_text()
    for name in EXTRAS:
        assert f"`{name}`" in page, f"docs/install.md does not describe the extra {name}"
    for script in PROJECT["scripts"]:
        assert script in page, f"docs/install.md does not name {script}"
