"""The house's layering, checked from the source: no import runs upward, no circle, report never reads the calibrator.

Every part of `nfab/` sits on a floor; a module may import its own part and parts on lower
floors only. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nfab"

FLOORS: dict[str, int] = {
    "errors": 0,
    "validation": 1, "fsutil": 1, "overrides": 1, "distributed": 1, "heads": 1,
    "wire": 2,
    "profile": 3,
    "runtime": 4, "models": 4,
    "data": 5, "attach_checks": 5, "loss": 5,
    "config": 6,
    "inspect": 7, "inspect_fsdp": 7,
    "calibrate": 8, "train": 8, "report": 8,
    "api": 9,
    "rankserver": 10, "bench": 10, "integrations": 10,
    "cli": 11,
}
"""Parts on one floor never import each other (calibrate, train and report are peers; bench and integrations
too). The integrations sit above calibrate: calibrating from a framework's objects calls `nfab.calibrate`.
`api` (`nfab.attach`) sits above it too: `attach(model, "auto")` calibrates inside the run (`calibrate.inrun`)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every nfab module `path` imports, at any depth of its body."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] == "nfab":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "nfab")
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "nfab"


def test_every_part_has_a_floor() -> None:
    parts = {_part(m) for m in _graph()} - {"nfab", "__main__"}
    assert parts <= set(FLOORS), f"parts without a floor: {sorted(parts - set(FLOORS))}"


def test_no_import_runs_upward() -> None:
    upward = []
    for module, targets in _graph().items():
        src = _part(module)
        if src in ("nfab", "__main__"):
            continue
        for target in targets:
            dst = _part(target)
            if dst == "nfab" or dst == src:  # `from nfab import __version__`, or the part itself
                continue
            if FLOORS[dst] >= FLOORS[src]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward or sideways:\n" + "\n".join(sorted(upward))


def test_report_never_reads_the_calibrator() -> None:
    offenders = [f"{m} -> {t}" for m, ts in _graph().items() if _part(m) == "report"
                 for t in ts if _part(t) == "calibrate"]
    assert not offenders, offenders


def test_no_import_circle() -> None:
    graph = _graph()
    # a package's __init__ importing its own submodules is not a circle of meaning: drop parent -> child edges
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_package_never_imports_the_checkouts_bench() -> None:
    """`bench/` (the study, the user loop, the held-out models) is not installed: nothing in `nfab/` imports it."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            offenders += [f"{path.relative_to(PACKAGE.parent)}: {n}" for n in names if n.split(".")[0] == "bench"]
    assert not offenders, offenders


MODULE_LINES_MAX = 600
"""The house's hard cap on a module's length (split one past 500)."""


def test_largest_module_is_small() -> None:
    limit = MODULE_LINES_MAX
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {k: v for k, v in sizes.items() if v > limit}
    assert not over, f"modules over {limit} lines: {over}"
