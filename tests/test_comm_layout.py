"""hf_zero/comm's files import each other one way: no module of the package reaches itself again through others.

The walk reads each ``hf_zero/comm/*.py`` with ``ast`` (nothing is imported) and takes every import of a sibling at
any depth -- module level, inside functions (the lazy imports that used to hide the process_group <-> collectives <->
faults circle), under ``TYPE_CHECKING``, relative or absolute. The package's ``__init__`` re-exports and is left
out: it sits above every file. process_group is a leaf among the comm modules that hold state: settings live in
settings.py, which imports no sibling.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_zero
from _import_graph import find_cycle

COMM = Path(hf_zero.__file__).resolve().parent / "comm"


def _siblings(path: Path, names: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from . import x / from .x import y
                if node.module is None:
                    out.update(a.name for a in node.names if a.name in names)
                else:
                    out.add(node.module.split(".")[0])
            elif node.level == 0 and node.module and node.module.startswith("hf_zero.comm"):
                rest = node.module.split(".")[2:]
                if rest:
                    out.add(rest[0])
                else:
                    out.update(a.name for a in node.names if a.name in names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == ["hf_zero", "comm"] and len(parts) > 2:
                    out.add(parts[2])
    return {n for n in out if n in names and n != path.stem}


def comm_graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in COMM.glob("*.py") if p.stem != "__init__"}
    return {name: _siblings(path, set(files)) for name, path in files.items()}


def test_the_walk_sees_lazy_imports():
    # the walk itself: a circle made only of imports inside functions is still a circle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = comm_graph()
    assert {"faults", "shm_ring", "collectives", "process_group", "settings", "context"} <= set(graph)
    assert "faults" in graph["collectives"]  # a known edge is found


def test_no_import_cycle_within_comm():
    graph = comm_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "hf_zero/comm imports in a circle: " + " -> ".join(cycle)


def test_process_group_and_settings_are_leaves():
    graph = comm_graph()
    assert graph["settings"] == set(), graph["settings"]
    # process_group may read the settings (the default timeout), where this process trains (device.py) and the
    # comms logger (itself a leaf: its DeepSpeed-signature all_reduce/broadcast/all_gather are timed there)
    assert graph["process_group"] <= {"settings", "device", "comms_log"}, graph["process_group"]
    assert graph["comms_log"] == set(), graph["comms_log"]
