"""The package's floors, read from the source (every ``import``, at any depth, ``TYPE_CHECKING`` ones included):
kv_preflight/fleet/ (the fleet's records, values) is below kv_preflight/index/ (the index, whose fleet store reads
and writes them), so nothing in fleet/ imports index/; and neither imports the processes above them."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "kv_preflight"
ABOVE = ("kv_preflight.ingester", "kv_preflight.predictor", "kv_preflight.cli", "kv_preflight.simulator")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module a file imports (``from a import b`` counts as ``a`` and ``a.b``: b may be a module)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def imports_from(room: str, forbidden: tuple[str, ...]) -> list[str]:
    """``module -> imported`` for each module under ``room`` importing anything under ``forbidden``."""
    out = []
    for path in sorted((PACKAGE / room).rglob("*.py")):
        for name in sorted(imported(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{module_name(path)} -> {name}")
    return out


def test_the_scan_sees_imports_at_any_depth_and_relative_ones(tmp_path):
    """The scan itself can fail: a nested, a TYPE_CHECKING and a relative import are all seen."""
    room = tmp_path / "kv_preflight" / "fleet"
    room.mkdir(parents=True)
    (room / "x.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kv_preflight.index import y\n"
                               "def f():\n    import kv_preflight.index.z\nfrom ..index import w\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "kv_preflight"
    try:
        got = imports_from("fleet", ("kv_preflight.index",))
    finally:
        PACKAGE = saved
    assert got == ["kv_preflight.fleet.x -> kv_preflight.index", "kv_preflight.fleet.x -> kv_preflight.index.w",
                   "kv_preflight.fleet.x -> kv_preflight.index.y", "kv_preflight.fleet.x -> kv_preflight.index.z"]


def test_fleet_does_not_import_the_index():
    """The fleet's records are values every process shares; their Valkey commands are the index's
    (index/fleet_store.py), a pod's leaving too (index/lifecycle.py): an import back would make the two one
    room drawn as two again."""
    assert imports_from("fleet", ("kv_preflight.index",)) == []


def test_the_index_and_the_fleet_import_no_process_above_them():
    assert imports_from("index", ABOVE) == []
    assert imports_from("fleet", ABOVE) == []


def import_cycles() -> list[list[str]]:
    """The package's modules that import each other round a circle (strongly connected parts of the graph of
    every import the scan sees, ``TYPE_CHECKING`` ones included), each part sorted."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: sorted(i for i in imported(p) if i in modules and i != m) for m, p in modules.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:  # Tarjan's, recursive: the package is far shallower than Python's limit
        order[m] = low[m] = len(order)
        stack.append(m)
        for n in graph[m]:
            if n not in order:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], order[n])
        if low[m] == order[m]:
            part = []
            while (n := stack.pop()) != m:
                part.append(n)
            if part:
                cycles.append(sorted([m, *part]))

    for m in sorted(graph):
        if m not in order:
            visit(m)
    return sorted(cycles)


def test_no_module_imports_itself_round_a_circle():
    """A circle, even through ``TYPE_CHECKING``, is two modules that cannot be read, tested or moved apart; the
    index had two (its backend protocol and the writer it names, the Index and its export/import)."""
    assert import_cycles() == []


def test_the_circle_scan_finds_a_circle_through_type_checking(tmp_path):
    room = tmp_path / "kv_preflight" / "index"
    room.mkdir(parents=True)
    (room / "a.py").write_text("from kv_preflight.index.b import x\n")
    (room / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kv_preflight.index import a\n")
    (room / "c.py").write_text("from kv_preflight.index import a\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "kv_preflight"
    try:
        assert import_cycles() == [["kv_preflight.index.a", "kv_preflight.index.b"]]
    finally:
        PACKAGE = saved


MAX_MODULE_LINES = 600  # a room one can read at a sitting (issue 41); a larger one is split by what it holds


def test_no_module_is_over_600_lines():
    big = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
