"""The import rules of the README ("Layout"): every module's imports, read from the source, with
no import circle and no import the table forbids. Lazy imports (inside functions) count: the
two circles this test was written against were lazy ones; so do imports under ``if
TYPE_CHECKING:`` (annotations only, never run), for circles and rules alike: a type-only
import is still an arrow a reader follows, and the circle the advisor once had was one.

``check(root)`` reads the packages under ``root`` and returns the violations as sentences, so the
planted-fault tests below run it on a copy of the tree with one bad import added.
"""

from __future__ import annotations

import ast
import functools
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mita", "service", "profiler", "loadtest")  # what a user imports
SCRIPTS = ("benchmarks", "tests")  # may import anything; nothing may import them
STDLIB = set(sys.stdlib_module_names)

# mita/'s ground floor: the configuration and the stage names, the standard library only.
GROUND = {"mita.config", "mita.hooks"}
# The wings of mita/ beside the method, and the third-party libraries each may use. Neither
# imports torch: the load tester, every command's argument checks and the gateway's
# tokenizing import them, and torch takes 1.5-2 s to import.
TOOLS_LIBRARIES = {"numpy", "tqdm", "matplotlib", "sklearn"}
DATA_LIBRARIES = {"numpy", "sentencepiece", "tokenizers",
                  "rdata", "sklearn"}  # the last two: python -m mita.data.datasets only
STAGE_MODULES = {"mita.stages", "mita.topk"}
# The dispatcher and its autograd half: the only modules of mita/ above the kernels to import them.
DISPATCHERS = {"mita.attention", "mita.joint"}
# loadtest is a client of the service over HTTP: data, the stage names, the commands' tools.
LOADTEST_MAY = {"mita.data", "mita.hooks", "mita.tools"}
NO_RAY = {"service.engine", "service.graphs"}  # the serving code path a GPU host runs without Ray
RAY_FREE_SERVICE = {"service", "service.graphs", "service.schemas", "service.settings"}
# The files split out of service/schemas.py and service/gateway.py by job: (libraries, project
# modules) each may import beyond the standard library. The configuration a person writes
# knows nothing of HTTP, Ray or the gateway; the classifier call (deadline, resends, errors)
# nothing of HTTP routes, the API's models or the gateway.
SPLIT = {"service.settings": ({"pydantic"}, {"mita.config"}),
         "service.calls": ({"ray", "grpc", "numpy"}, {"service.inputs", "service.settings"})}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _imports_of(text: str) -> tuple[tuple[str, str, int], ...]:
    """``(module or "", name or "", level)`` of every import statement in ``text`` (parsed
    once per distinct text: the planted-fault tests read a copy of the tree)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(alias.name, "", 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.module or "", alias.name, node.level) for alias in node.names]
    return tuple(out)


def read_imports(root: Path) -> dict[str, set[str]]:
    """``{module: every module or top-level library it imports}``, relative imports resolved;
    ``from pkg import name`` is an import of ``pkg.name`` when that is a module of the tree."""
    files = {module_name(p, root): p for top in PACKAGES + SCRIPTS
             for p in (root / top).rglob("*.py")}
    out = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for module, alias, level in _imports_of(path.read_text()):
            if module and _top(module) == "mutmut":  # make mutate's copy: its trampolines
                continue
            if not alias:
                found.add(module)
                continue
            if level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - level + 1] + ([module] if module else []))
            else:
                base = module
            sub = f"{base}.{alias}"
            found.add(sub if sub in files else base)
        out[name] = found
    return out


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden(importer: str, imported: str) -> str | None:
    """Why the import rules forbid ``importer`` → ``imported`` (a module of the tree or a
    top-level library), or None when they allow it."""
    top = _top(imported)
    if top in SCRIPTS and _top(importer) in PACKAGES:
        return "nothing imports benchmarks/ or tests/"
    if _within(imported, "mita.training") and not _within(importer, "mita"):
        return "nothing outside mita/, tests/ and benchmarks/ imports mita/training/"
    if importer in SPLIT:
        libraries, modules = SPLIT[importer]
        if top in STDLIB or top in libraries or imported in modules:
            return None
        return ("service/settings.py imports pydantic and mita.config only"
                if importer == "service.settings" else
                "service/calls.py imports ray, grpc, numpy, service.inputs and "
                "service.settings only")
    if importer in GROUND:
        if top in STDLIB:
            return None
        return "mita/config.py and mita/hooks.py import the standard library only"
    if _within(importer, "mita.tools"):
        if top in STDLIB or top in TOOLS_LIBRARIES or imported in GROUND or _within(
                imported, "mita.tools"):
            return None
        return ("mita/tools/ imports numpy, tqdm, matplotlib, scikit-learn, config, hooks and "
                "its own files only: never torch")
    if _within(importer, "mita.data"):
        if top in STDLIB or top in DATA_LIBRARIES or imported in GROUND or any(
                _within(imported, w) for w in ("mita.tools", "mita.data")):
            return None
        return ("mita/data/ imports numpy, sentencepiece (rdata and scikit-learn: the data-set "
                "command), config, hooks, mita/tools/ and its own files only: never torch")
    if top in PACKAGES:
        return _project_rule(importer, imported)
    return None


def _project_rule(importer: str, imported: str) -> str | None:
    if importer in STAGE_MODULES:
        if imported in GROUND | STAGE_MODULES:
            return None
        return "the stages and top-k helpers import torch, config, hooks only"
    if _within(importer, "mita.kernels"):
        if imported in DISPATCHERS:
            return "mita/kernels/ never imports the dispatchers (mita/attention.py, joint.py)"
        # mita.tools.argtypes: the CLI of the kernel table (python -m mita.kernels.aot_table)
        if imported in GROUND | STAGE_MODULES | {"mita.tools.argtypes"} or _within(
                imported, "mita.kernels"):
            return None
        return ("mita/kernels/ imports the stages, hooks, config, mita.tools.argtypes and its "
                "own files only")
    if importer in DISPATCHERS:
        if imported in GROUND | STAGE_MODULES | DISPATCHERS or _within(imported, "mita.kernels"):
            return None
        return ("mita/attention.py and mita/joint.py import config, hooks, stages and kernels "
                "only")
    if _within(importer, "mita.training"):
        return None if _within(imported, "mita") else (
            "mita/training/ imports mita/ only (no service/, profiler/, loadtest/)")
    if _within(importer, "mita"):  # the method's top floor and the classifier
        if _within(imported, "mita.kernels") and importer != "mita":
            return "only mita/attention.py and mita/joint.py import mita/kernels/"
        if any(_within(imported, w) for w in ("mita.data", "mita.training")):
            return "the method and its classifier never import mita/data/ or mita/training/"
        if _within(imported, "mita"):
            return None
        return "mita/ imports no service/, profiler/, loadtest/"
    if importer in NO_RAY:
        if _within(imported, "mita") or imported in RAY_FREE_SERVICE:
            return None
        return "service/engine.py and graphs.py import mita (and Ray-free service files) only"
    if _within(importer, "service"):
        if _within(imported, "mita") or _within(imported, "service"):
            return None
        return "service/ never imports profiler/ or loadtest/"
    if _within(importer, "profiler"):
        if _within(imported, "mita") or _within(imported, "profiler") or \
                imported == "service.engine":
            return None
        return "profiler/ imports mita/ and service.engine only"
    if _within(importer, "loadtest"):
        if _within(imported, "loadtest") or any(_within(imported, m) for m in LOADTEST_MAY):
            return None
        return "loadtest/ imports mita.data, mita.hooks and mita.tools only"
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among the packages' modules (strongly connected components of more
    than one module, or a module importing itself), each sorted."""
    nodes = [n for n in graph if _top(n) in PACKAGES]
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the graph is a few hundred edges
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph or _top(w) not in PACKAGES:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1 or v in graph.get(v, ()):
                found.append(sorted(scc))

    for n in nodes:
        if n not in index:
            visit(n)
    return found


def check(root: Path) -> list[str]:
    """Every violation of the layer table under ``root``, as sentences."""
    graph = read_imports(root)
    out = [f"import circle: {' ↔ '.join(c)}" for c in circles(graph)]
    for importer, imported in sorted((a, b) for a, bs in graph.items() for b in bs):
        if _top(importer) in SCRIPTS:
            continue
        why = forbidden(importer, imported)
        if why:
            out.append(f"{importer} imports {imported}: {why}")
    for start in NO_RAY:  # the Ray-free path, followed through every import
        seen, todo = set(), [start]
        while todo:
            mod = todo.pop()
            if mod in seen:
                continue
            seen.add(mod)
            for imp in graph.get(mod, ()):
                if _top(imp) == "ray":
                    out.append(f"{start} reaches ray through {mod}")
                elif imp in graph:
                    todo.append(imp)
    return out


def test_the_tree_keeps_the_layer_table():
    assert check(ROOT) == []


def test_the_reader_sees_lazy_and_relative_imports():
    graph = read_imports(ROOT)
    # relative, to a sibling module and to the package's own name
    assert "mita.kernels.triton_common" in graph["mita.kernels.routing"]
    assert "mita.kernels" in graph["mita.kernels.routing"]  # from . import MAX_HEAD_DIM
    assert "mita.stages" in graph["mita.kernels.choose"]  # from .. import stages as S
    assert "mita.kernels.triton_mita" in graph["mita.attention"]  # lazy, inside a function


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the tree's Python files, clean before any plant."""
    root = tmp_path_factory.mktemp("tree")
    for top in PACKAGES + SCRIPTS:
        shutil.copytree(ROOT / top, root / top, ignore=shutil.ignore_patterns(
            "__pycache__", "*.so", "*.cpp", "*.md", "static", "build"))
    assert check(root) == []
    return root


def _lazy(line: str) -> str:
    """``line`` planted inside a function: an import that runs only when it is called."""
    return f"def _planted():\n    {line}\n"


PLANTS = [
    # a circle: the config (ground floor) back to the dispatcher that imports it
    ("mita.config", _lazy("from . import attention"),
     ["import circle: mita.attention ↔ mita.config",
      "mita.config imports mita.attention: mita/config.py and mita/hooks.py import the "
      "standard library only"]),
    # the circle issue 30 found: a launcher importing the dispatcher
    ("mita.kernels.cpu", _lazy("from .. import attention"),
     ["import circle: mita.attention ↔ mita.joint ↔ mita.kernels.cpu",
      "mita.kernels.cpu imports mita.attention: mita/kernels/ never imports the dispatchers "
      "(mita/attention.py, joint.py)"]),
    # a circle through an annotation-only import (the advisor's, issue 63)
    ("profiler.recommend", "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
     "    from .advise import AdviseConfig\n",
     ["import circle: profiler.advise ↔ profiler.recommend"]),
    # the wings: training is the end of the line, data never needs torch, the model never
    # reads data
    ("service.gateway", _lazy("from mita.training import fit"),
     ["service.gateway imports mita.training.fit: nothing outside mita/, tests/ and "
      "benchmarks/ imports mita/training/"]),
    ("profiler.sweep", "import mita.training\n",
     ["profiler.sweep imports mita.training: nothing outside mita/, tests/ and benchmarks/ "
      "imports mita/training/"]),
    ("mita.data.labelled", "import torch\n",
     ["mita.data.labelled imports torch: mita/data/ imports numpy, sentencepiece (rdata and "
      "scikit-learn: the data-set command), config, hooks, mita/tools/ and its own files "
      "only: never torch"]),
    ("mita.model", _lazy("from .data.task import Task"),
     ["mita.model imports mita.data.task: the method and its classifier never import "
      "mita/data/ or mita/training/"]),
    ("mita.timer", _lazy("from .training import fit"),
     ["mita.timer imports mita.training.fit: the method and its classifier never import "
      "mita/data/ or mita/training/"]),
    ("mita.tools.progress", "import torch\n",
     ["mita.tools.progress imports torch: mita/tools/ imports numpy, tqdm, matplotlib, "
      "scikit-learn, config, hooks and its own files only: never torch"]),
    # upward arrows without a circle
    ("service.stats", _lazy("from profiler import sweep"),
     ["service.stats imports profiler.sweep: service/ never imports profiler/ or loadtest/"]),
    ("service.engine", _lazy("import ray"),
     ["service.engine reaches ray through service.engine"]),
    # the split by job: the configuration models back to the API's, the call to the routes
    ("service.settings", _lazy("from .schemas import ClassifyRequest"),
     ["import circle: service.schemas ↔ service.settings",
      "service.settings imports service.schemas: service/settings.py imports pydantic and "
      "mita.config only"]),
    ("service.settings", _lazy("import fastapi"),
     ["service.settings imports fastapi: service/settings.py imports pydantic and mita.config "
      "only"]),
    ("service.calls", _lazy("from .http import CLASSIFY_PATHS"),
     ["service.calls imports service.http: service/calls.py imports ray, grpc, numpy, "
      "service.inputs and service.settings only"]),
    ("loadtest.engine", _lazy("import mita.model"),
     ["loadtest.engine imports mita.model: loadtest/ imports mita.data, mita.hooks and "
      "mita.tools only"]),
    # the stages reaching up to the model close a circle through every launcher
    ("mita.stages", _lazy("import mita.model"),
     ["import circle: mita.attention ↔ mita.joint ↔ mita.kernels.choose ↔ mita.kernels.cpu ↔ "
      "mita.kernels.triton_mita ↔ mita.layers ↔ mita.model ↔ mita.stages",
      "mita.stages imports mita.model: the stages and top-k helpers import torch, config, "
      "hooks only"]),
]


@pytest.mark.parametrize("module,code,expected", PLANTS,
                         ids=[f"{i}-{m}" for i, (m, _, _) in enumerate(PLANTS)])
def test_a_planted_fault_is_found(tree, module, code, expected):
    path = tree / (module.replace(".", "/") + ".py")
    clean = path.read_text()
    path.write_text(f"{clean}\n\n{code}")
    try:
        assert check(tree) == expected
    finally:
        path.write_text(clean)
