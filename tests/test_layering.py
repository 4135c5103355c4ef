"""Imports point one way: every edge between hf_zero's packages goes from a higher layer to a lower one.

The walk reads every module's source (no import is executed) and collects every reference to another hf_zero
module: ``import``/``from ... import`` at any depth (module level, inside functions, under ``TYPE_CHECKING``,
relative or absolute) and the ``"hf_zero.pkg.module"`` strings of lazy re-export tables and shim forwards. An edge
from package A to a different package B is allowed only when ``LAYERS[A] > LAYERS[B]``; packages on the same layer
may not import each other. So there can be no package cycle, and a cycle report below would mean the table itself
is broken.

A new package must be added to ``LAYERS`` (the test fails on a package it does not know), at the layer that says
what it may import. Modules directly in ``hf_zero/`` (``__init__``, ``cli``, ``doctor``, ``testing``) sit at the top.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import hf_zero
from _import_graph import find_cycle

# Higher imports lower. Same number: peers that may not import each other.
LAYERS = {
    "<top>": 10,         # hf_zero/__init__.py, cli.py, doctor.py, testing.py, __main__.py
    "integrations": 9,   # HF Trainer/accelerate glue and the `deepspeed` shim
    "runtime": 8,        # the engine: composes everything below from the config
    "checkpoint": 7,     # every checkpoint's format, commit and re-cut; takes the engine as an argument
    "pipeline": 6,
    "compression": 6,
    "tensor_parallel": 6,
    "sequence_parallel": 6,  # Ulysses attention wrapper, data-loader adapter, loss aggregation
    "zero": 5,           # sharding, ZeRO-3 runtime; declares the storage interfaces offload implements
    "offload": 4,        # where off-device bytes live: swap files, optimizer-state tiers; knows nothing of zero
    "profiling": 3,      # timers and memory readers; imports nothing above comm
    "parallel": 2,       # ParallelDims and the run's one device mesh; imports comm and config only
    "moe": 2,            # the MoE layer (gating, experts): a model building block; imports comm only (the
                         # expert-parallel groups and the token all-to-all)
    "comm": 1,
    "launcher": 1,       # the `hf-zero launch` / `deepspeed` command line over torch.distributed.run
    "ops": 1,
    "config": 1,
    "util": 0,           # helpers any package may use (lazy exports); imports no hf_zero package
}

# Back edges still to be removed, each with the reason it exists; the test fails when one disappears (so the entry
# is deleted with the fix) and on any edge not listed.
KNOWN_BACK_EDGES: dict[str, str] = {}

ROOT = Path(hf_zero.__file__).resolve().parent
_MODULE_STRING = re.compile(r"hf_zero(\.\w+)+(:\w+)?")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    if module.startswith("hf_zero._C"):  # the compiled extensions (_C, _C_cuda) are ops' native half
        return "ops"
    parts = module.split(".")
    if len(parts) < 2:
        return "<top>"
    sub = ROOT / parts[1]
    return parts[1] if sub.is_dir() else "<top>"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported hf_zero module, line) for every reference in ``path``."""
    module = _module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstring_nodes(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "hf_zero":  # `from hf_zero import comm` imports hf_zero.comm
                out += [(f"hf_zero.{a.name}", node.lineno) for a in node.names if a.name != "__version__"]
            else:
                out.append((target, node.lineno))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and _MODULE_STRING.fullmatch(node.value)):
            out.append((node.value.split(":")[0], node.lineno))
    return [(t, line) for t, line in out if t == "hf_zero" or t.startswith("hf_zero.")]


def _edges() -> list[tuple[str, str, str]]:
    """(importing package, imported package, "file:line -> module") for every cross-package reference."""
    edges = []
    for path in sorted(ROOT.rglob("*.py")):
        src = _package(_module_name(path))
        for target, line in _imports(path):
            dst = _package(target)
            if dst != src:
                edges.append((src, dst, f"{path.relative_to(ROOT.parent)}:{line} -> {target}"))
    return edges


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"hf_zero packages with no layer: {missing}; add them to LAYERS in {__file__}"


def _upward_edges() -> list[tuple[str, str, str]]:
    return [(src, dst, where) for src, dst, where in _edges() if LAYERS[src] <= LAYERS[dst]]


def _file_and_target(where: str) -> str:
    path, target = where.split(" -> ")
    return f"{path.rsplit(':', 1)[0]} -> {target}"


def test_imports_point_down():
    upward = [f"{src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]}): {where}"
              for src, dst, where in _upward_edges() if _file_and_target(where) not in KNOWN_BACK_EDGES]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)
    stale = set(KNOWN_BACK_EDGES) - {_file_and_target(where) for _, _, where in _upward_edges()}
    assert not stale, f"fixed back edges still listed in KNOWN_BACK_EDGES: {sorted(stale)}"


def test_no_package_cycle():
    graph: dict[str, set[str]] = {}
    for src, dst, where in _edges():
        if _file_and_target(where) not in KNOWN_BACK_EDGES:
            graph.setdefault(src, set()).add(dst)
    cycle = find_cycle(graph)
    if cycle:
        raise AssertionError("package cycle: " + " -> ".join(cycle))


def test_walk_sees_function_level_relative_and_string_imports(tmp_path, monkeypatch):
    """The walk itself: imports hidden in functions, TYPE_CHECKING blocks, relative forms and lazy tables count."""
    pkg = tmp_path / "hf_zero"
    (pkg / "zero").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "zero" / "__init__.py").write_text('"""doc naming hf_zero.runtime.engine is not an import"""\n'
                                              '_LAZY = {"X": "hf_zero.offload.swapper"}\n')
    (pkg / "zero" / "m.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hf_zero.runtime import engine\n"
        "def f():\n    from ..profiling.timers import NO_TIMERS\n    import hf_zero.integrations\n"
        "from . import layout\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    found = set(_imports(pkg / "zero" / "m.py"))
    lazy = _imports(pkg / "zero" / "__init__.py")
    assert found == {("hf_zero.runtime", 3), ("hf_zero.profiling.timers", 5), ("hf_zero.integrations", 6),
                     ("hf_zero.zero", 7)}
    assert lazy == [("hf_zero.offload.swapper", 2)]


# zero/ and offload/ act on the frozen policies config/policies.py translates the schema into, never on the schema.
SCHEMA_FREE = ("zero", "offload")
CONFIG_MODULES_THEY_MAY_USE = {"hf_zero.config.policies", "hf_zero.config.errors", "hf_zero.config.loader"}


def test_zero_and_offload_never_see_the_schema():
    reads = [where for src, dst, where in _edges()
             if src in SCHEMA_FREE and dst == "config" and where.split(" -> ")[1] not in CONFIG_MODULES_THEY_MAY_USE]
    assert not reads, "zero/offload reading the config schema instead of a policy:\n" + "\n".join(reads)


def test_every_package_docstring_says_what_it_may_import():
    """Each package's ``__init__`` docstring states what it owns and what it may import, pointing at this table."""
    vague = []
    for name in sorted(set(LAYERS) - {"<top>"}):
        doc = ast.get_docstring(ast.parse((ROOT / name / "__init__.py").read_text())) or ""
        if "import" not in doc or "LAYERS" not in doc:
            vague.append(name)
    assert not vague, f"package docstrings that do not say what the package may import (and cite LAYERS): {vague}"
