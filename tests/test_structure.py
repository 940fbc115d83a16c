"""The package's structure, read from the source (fast: no export, no model): no import circle among the
higgs_onnx modules, counting every import (module level, inside functions, under `if TYPE_CHECKING:`), and the
runtime facade's names importable from where callers import them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "higgs_onnx"


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package's __init__)} for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _owner(name: str, known: dict) -> str | None:
    """The package module `name` refers to: itself, or the module that defines it (`pkg.mod.Name` -> `pkg.mod`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, is_package: bool, known: dict) -> set[str]:
    """The package modules that importing module `name` imports: every `import` / `from ... import` anywhere in
    its file (functions and TYPE_CHECKING blocks included), resolved to modules, plus the packages those live in
    that are not `name`'s own parents (importing `a.b.c` runs `a/b/__init__.py` first)."""
    here = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, known)
            while owner:  # the module and the packages above it that `name` is not inside of
                if owner != name and not name.startswith(owner + "."):
                    found.add(owner)
                owner = owner.rpartition(".")[0] or None
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, pkg, known) for name, (path, pkg) in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as one circle's path."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(_circle(graph, set(group)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """One circle through the group, for the failure message: start -> ... -> start."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return [*path, start]
            if w not in seen:
                seen.add(w)
                paths.append([*path, w])
    return sorted(group)


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and graph["higgs_onnx.runtime.model"]  # the walk found the package and its imports
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_graph_counts_function_level_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from .. import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    known = modules(pkg)
    graph = {n: imports(n, p, is_pkg, known) for n, (p, is_pkg) in known.items()}
    assert graph["pkg.a"] == {"pkg.sub.b", "pkg.sub"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]


def test_the_runtime_facade_reexports_its_pieces():
    from higgs_onnx.runtime import backend, codec, model, voice
    from higgs_onnx.runtime.model import HiggsTTS, OnnxBackend, Voice, VoiceFileError

    assert OnnxBackend is backend.OnnxBackend and Voice is voice.Voice and VoiceFileError is voice.VoiceFileError
    assert isinstance(HiggsTTS.backend, property) and isinstance(HiggsTTS.kv_memory, property)
    assert model.OnnxCodec is codec.OnnxCodec


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's folders (`higgs_onnx.serve`, `higgs_onnx.runtime`, ...; a top-level
    module is a node of its own, and so is a folder's `__main__`: a command's entry point, which no module imports):
    an arrow wherever a module of one imports a module of the other."""
    def folder(name: str) -> str:
        return name if name.endswith(".__main__") else ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(folder(a), set())
        for b in targets:
            if folder(b) != folder(a) and folder(b) != "higgs_onnx":
                out[folder(a)].add(folder(b))
    return out


def test_the_package_has_no_folder_import_circle():
    """No two folders import each other, even through others (issue 34 removed five: generation <-> runtime,
    generation <-> guard, guard <-> runtime, parts <-> runtime, serve <-> wyoming)."""
    graph = folder_graph(import_graph())
    assert {"higgs_onnx.serve", "higgs_onnx.runtime", "higgs_onnx.job"} <= set(graph)
    found = cycles(graph)
    assert not found, "folder circles: " + "; ".join(" -> ".join(c) for c in found)


def test_runtime_imports_nothing_from_job_and_no_command_sits_in_a_library_folder():
    """`job/` runs a job one floor above `runtime/` (issue 42): no runtime module imports a job module, even inside
    a function. And the guard (NumPy only, imported by the engine) holds no command: a `__main__` inside it drew
    the only arrows from guard/ up to the runtime; its command is `higgs_onnx.judge`."""
    graph = import_graph()
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("higgs_onnx.runtime")
                for b in targets if b.startswith("higgs_onnx.job"))
    assert not up, up
    guard = folder_graph(graph)["higgs_onnx.guard"]
    assert "higgs_onnx.guard.__main__" not in graph and guard <= {"higgs_onnx.tags"}, guard


def test_the_folder_graph_sees_a_circle_through_three_folders():
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.c.z"}, "p.c.z": {"p.a.w"}, "p.a.w": set(), "p.a.__main__": {"p.c.z"}}
    assert cycles(folder_graph(graph)) == [["p.a", "p.b", "p.c", "p.a"]]
    del graph["p.c.z"]
    graph["p.c.z"] = set()
    assert cycles(folder_graph(graph)) == []


def test_no_private_name_is_imported_from_another_module():
    """`from .x import _name` couples a module to another's internals: such names are made public or kept home."""
    found = []
    for name, (path, _) in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("higgs_onnx")):
                found += [f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not found, found


def test_no_test_skips_a_pinned_package():
    """A pinned dependency (requirements.txt) that is missing is a broken install: its tests fail, never skip."""
    import re

    root = Path(__file__).resolve().parent.parent
    pinned = {re.split(r"[=<>\[ ]", line.strip(), maxsplit=1)[0].lower().replace("-", "_")
              for line in (root / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    skipped = []
    for path in sorted((root / "tests").glob("*.py")):
        for call in re.findall(r"importorskip\(\s*[\"']([\w.]+)", path.read_text()):
            if call.split(".")[0].lower() in pinned:
                skipped.append(f"{path.name}: {call}")
    assert "pocketsphinx" in pinned and not skipped, skipped


def test_docs_layout_names_every_module():
    """docs/layout.md describes today's modules: every file of the package is named there (a part's own module by
    its line, 'one module per exported part')."""
    from higgs_onnx.part_facts import FACTS

    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            if path.parent != PACKAGE and f"{path.parent.name}/" not in layout:
                missing.append(f"{path.parent.relative_to(PACKAGE)}/")
        elif path.name not in layout and not (path.parent.name == "parts" and path.stem in FACTS):
            missing.append(str(path.relative_to(PACKAGE)))
    assert not missing, f"docs/layout.md does not name {missing}"
    assert "PieceCue" not in layout  # merged into longform.captions.Cue


TESTS = PACKAGE.parent / "tests"


def test_test_modules_share_helpers_through_support_modules_and_start_servers_in_one_place():
    """A test module imports no other test module and no conftest (what two of them share lives in a support
    module: servers.py, ws_clients.py, ...; a conftest value is a fixture), and starts a speech server only through
    `servers.served` (one start, stop and log check)."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and path.name != "servers.py"
                  and node.func.id in ("Server", "ServerProcess")):
                found.append(f"{path.name}:{node.lineno}: {node.func.id}(...), not servers.served")
                continue
            else:
                continue
            found += [f"{path.name}:{node.lineno}: imports {n}" for n in names
                      if n.rpartition(".")[2].startswith("test_") or n.rpartition(".")[2] == "conftest"]
    assert not found, found


def repo_files() -> list[str]:
    """The repository's files as git lists them: tracked, and new ones it does not ignore (deleted ones left out)."""
    import subprocess

    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=PACKAGE.parent, capture_output=True,
                         text=True, check=True).stdout
    return [f for f in out.splitlines() if (PACKAGE.parent / f).is_file()]


def layout_entries(layout: str) -> dict[str, str]:
    """docs/layout.md's tree as {an entry's name column (what a line starting at column 0 names before its
    description): the entry's whole text, its indented lines included}."""
    tree = layout.split("```")[1]
    entries: dict[str, str] = {}
    key = None
    for line in tree.splitlines():
        if line and not line[0].isspace():
            key = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            entries[key] = line
        elif key is not None:
            entries[key] += "\n" + line
    return entries


def test_docs_layout_names_every_file_outside_the_package():
    """Every file outside the package is named in docs/layout.md where it lives: a top-level file in the name column,
    a benchmark, script or test support module (every .py outside the package but the test modules themselves) in its
    folder's entry; and every Makefile target in the Makefile's."""
    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    entries = layout_entries(layout)
    names = {n for key in entries for n in key.split()}
    missing = []
    for f in repo_files():
        folder, _, rest = f.partition("/")
        if not rest:
            if f not in names:
                missing.append(f)
        elif f.endswith(".py") and folder != "higgs_onnx" and not re.fullmatch(r"tests/test_\w+\.py", f):
            if not re.search(rf"(?<![\w/]){re.escape(rest)}\b", entries.get(f"{folder}/", "")):
                missing.append(f)
    assert ".ci/run" in names and "benchmarks/" in entries and "tests/" in entries
    assert not missing, f"docs/layout.md does not name {missing} in its folder's entry"
    phony = re.search(r"^\.PHONY:(.*)$", (PACKAGE.parent / "Makefile").read_text(), re.M).group(1).split()
    make = entries["Makefile"]
    assert phony and not [t for t in phony if not re.search(rf"\b{re.escape(t)}\b", make)], (phony, make)


def test_every_file_docs_layout_names_exists():
    """The other way round: a file docs/layout.md names (a .py, .md, .txt, .toml or .tsv name, with or without its
    folders) is a file of the repository, so a file that moves or goes takes its line with it."""
    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    files = repo_files()
    named = set(re.findall(r"(?<![\w./-])([\w./-]*\w\.(?:py|md|txt|toml|tsv))\b", layout))
    gone = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert len(named) > 100 and not gone, f"docs/layout.md names files that do not exist: {gone}"


# -- the docs' claims that a test can hold (issue 54: five of ten checked were stale) --------------------------------
DOCS = PACKAGE.parent / "docs"
# paths the docs name that are not this repository's: what a command writes (X/, out/, onnx/) and other projects' files
NOT_OURS = ("X/", "out/", "onnx/", "backend/open_webui/", "sglang_omni/")


def test_the_docs_name_only_files_that_exist():
    """A repository path the docs or the README name (`folder/file.py`, `.md`, `.txt`, `.toml`, `.tsv`, `.wav`) is a
    file of the repository: a module that moves (realspeech.py to tests/) or a benchmark that never was
    (benchmarks/aligner.py) cannot stay named."""
    files = set(repo_files())
    gone = []
    for page in [*sorted(DOCS.glob("*.md")), PACKAGE.parent / "README.md"]:
        for name in set(re.findall(r"(?<![\w./-])((?:\.\./)?(?:[\w.-]+/)+[\w.-]*\w\.(?:py|md|txt|toml|tsv|wav))\b",
                                   page.read_text())):
            path = (page.parent / name).resolve().relative_to(PACKAGE.parent) if name.startswith("../") else name
            if not name.startswith(NOT_OURS) and not any(f == str(path) or f.endswith(f"/{path}") for f in files):
                gone.append(f"{page.name}: {name}")
    assert not gone, f"the docs name files that do not exist: {gone}"


def test_the_docs_index_and_the_readme_list_every_page():
    """docs/README.md's table links every page of docs/, and so does the README's Documentation paragraph."""
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    index = set(re.findall(r"^\| \[[\w-]+\.md\]\(([\w-]+\.md)\)", (DOCS / "README.md").read_text(), re.M))
    readme = (PACKAGE.parent / "README.md").read_text()
    listed = set(re.findall(r"\(docs/([\w-]+\.md)\)", readme[readme.index("## Documentation"):])) - {"README.md"}
    assert len(pages) > 15 and index == pages and listed == pages, (index ^ pages, listed ^ pages)


def test_performance_lists_every_benchmark():
    """docs/performance.md's table says where every script of benchmarks/ has its figures, and names no other."""
    text = (DOCS / "performance.md").read_text()
    table = text[:text.index("\n## ")]
    named = set(re.findall(r"`benchmarks/(\w+\.py)", table))
    scripts = {p.name for p in (PACKAGE.parent / "benchmarks").glob("*.py")}
    assert named == scripts, (scripts - named, named - scripts)
