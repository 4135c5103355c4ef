"""A private name stays private: no hf_zero module imports another module's ``_name``, and the files of the packages
that were once knotted (comm, checkpoint) import each other in one direction only.

The walk reads every module's source with ``ast`` (nothing is imported): every ``from X import name`` (absolute or
relative, at any depth) and ``import X.Y`` is resolved to the dotted path it names. The first private component of
that path (``_name``, not ``__dunder__``) has an owner:

* a private *module* (``ops/_native.py``, ``deepspeed_shim/_finder.py``) is its package's: any module inside that
  package may import it, nothing outside;
* a private *name* inside a module (a function, class or constant) is that module's alone.

``KNOWN_PRIVATE_IMPORTS`` would list the ones still to be removed, each with why; the test fails on any import not
listed and on a listed one that is gone, so the list only shrinks. It is empty: issue #25 asks for none.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_zero
from _import_graph import find_cycle

ROOT = Path(hf_zero.__file__).resolve().parent

# "importing/file.py -> hf_zero.owner._name": why it is still there. Empty: no module imports another's private name.
KNOWN_PRIVATE_IMPORTS: dict[str, str] = {}

# packages whose files must not import each other in a circle (issue #25: process_group <-> collectives <-> faults,
# pipe_checkpoint <-> pipe_tp_checkpoint)
ACYCLIC_PACKAGES = ("comm", "checkpoint")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, root: Path) -> bool:
    """Whether ``dotted`` (hf_zero.x.y) is a module or package on disk, rather than a name inside one."""
    if dotted == "hf_zero":
        return True
    base = root.joinpath(*dotted.split(".")[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _references(path: Path, root: Path) -> list[tuple[str, int]]:
    """(imported dotted path, line) of every hf_zero import in ``path``: ``from X import a`` gives ``X.a``."""
    module = _module_name(path, root)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    return [(t, line) for t, line in out if t.startswith("hf_zero.")]


def private_imports(root: Path = ROOT) -> list[str]:
    """``"file.py:line -> hf_zero.owner._name"`` for every import of a private name by a module that does not own it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = _module_name(path, root)
        for dotted, line in _references(path, root):
            parts = dotted.split(".")
            for i in range(1, len(parts)):  # every private component: a private name in a private module counts
                if not _private(parts[i]) or parts[i] in ("_C", "_C_cuda"):  # the compiled extensions: ops' native
                    continue                                                 # half, loaded by name
                owner = ".".join(parts[:i])  # the package of a private module, the module of a private name
                private_module = _is_module(".".join(parts[:i + 1]), root)
                # a private module: any module of its package; a private name: its own module only
                if not (importer == owner or (private_module and importer.startswith(owner + "."))):
                    found.append(f"{path.relative_to(root.parent)}:{line} -> {'.'.join(parts[:i + 1])}")
                    break
    return found


def _file_and_target(where: str) -> str:
    path, target = where.split(" -> ")
    return f"{path.rsplit(':', 1)[0]} -> {target}"


def test_no_module_imports_another_modules_private_name():
    found = private_imports()
    offenders = [w for w in found if _file_and_target(w) not in KNOWN_PRIVATE_IMPORTS]
    assert not offenders, ("imports of another module's private name (make the name public, or move the code to "
                           "its owner):\n" + "\n".join(offenders))
    stale = set(KNOWN_PRIVATE_IMPORTS) - {_file_and_target(w) for w in found}
    assert not stale, f"fixed private imports still listed in KNOWN_PRIVATE_IMPORTS: {sorted(stale)}"


def _file_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (any depth, relative or absolute, names resolved to the
    module that defines them: ``from hf_zero.comm import faults`` is an edge to hf_zero.comm.faults)."""
    pkg = f"hf_zero.{package}"
    graph: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        src = _module_name(path, root)
        edges = graph.setdefault(src, set())
        for dotted, _ in _references(path, root):
            if not (dotted == pkg or dotted.startswith(pkg + ".")):
                continue
            # the longest prefix that is a module: the file this import reads
            parts = dotted.split(".")
            target = next(".".join(parts[:k]) for k in range(len(parts), 0, -1)
                          if _is_module(".".join(parts[:k]), root))
            if target != src and target != pkg:  # the package's __init__ re-exports; it is not a peer file
                edges.add(target)
    return graph


def test_no_import_cycle_between_files_of_comm_or_checkpoint():
    cycles = {p: find_cycle(_file_graph(p)) for p in ACYCLIC_PACKAGES}
    bad = {p: " -> ".join(c) for p, c in cycles.items() if c}
    assert not bad, f"files that import each other in a circle: {bad}"


def test_the_walk_sees_private_names_modules_and_cycles(tmp_path):
    """The walk itself, on a made-up tree: what counts as another module's private name, and a file cycle."""
    pkg = tmp_path / "hf_zero"
    for d in ("a", "b", "b/sub"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "_impl.py").write_text("def f():\n    pass\n")
    (pkg / "a" / "m.py").write_text("from ._impl import f\n_HIDDEN = 1\ndef g():\n    from .n import h\n")
    (pkg / "a" / "n.py").write_text("from hf_zero.a.m import _HIDDEN\nfrom .m import g\ndef h():\n    pass\n")
    (pkg / "b" / "x.py").write_text("from hf_zero.a import _impl\nimport hf_zero.a._impl\n"
                                    "from hf_zero.a.m import g, __doc__\n")
    (pkg / "b" / "sub" / "y.py").write_text("from ..x import _z\n")
    (pkg / "a" / "__init__.py").write_text("from ._impl import _private_there\n")
    found = private_imports(pkg)
    # a private name is its module's alone, even inside the package's own private module
    assert found == ["hf_zero/a/__init__.py:1 -> hf_zero.a._impl._private_there",
                     "hf_zero/a/n.py:1 -> hf_zero.a.m._HIDDEN",
                     "hf_zero/b/sub/y.py:1 -> hf_zero.b.x._z",
                     "hf_zero/b/x.py:1 -> hf_zero.a._impl",        # a private module: its package only
                     "hf_zero/b/x.py:2 -> hf_zero.a._impl"]
    graph = _file_graph("a", pkg)
    assert graph["hf_zero.a.m"] == {"hf_zero.a._impl", "hf_zero.a.n"}
    assert find_cycle(graph) == ["hf_zero.a.m", "hf_zero.a.n", "hf_zero.a.m"]
    assert find_cycle(_file_graph("b", pkg)) is None
