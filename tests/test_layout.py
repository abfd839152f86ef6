"""The package layout keeps data flowing one way: measure -> record -> fit -> plan -> decide.

Walks every import statement of kvbench (module level and inside functions: a lazy import
is still a dependency) and fails on an import cycle between modules or on a lower layer
importing a higher one. The checker itself is proven on planted graphs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvbench"

# Lowest first. A module may import its own layer's package and anything below.
LAYERS = (
    ("kvbench", "kvbench.units", "kvbench.cli"),  # kvbench.errors: under "kvbench", below all
    ("kvbench.records",),
    ("kvbench.model",),
    ("kvbench.p2p",),
    ("kvbench.fit",),
    ("kvbench.matrix",),
    ("kvbench.plan",),
    ("kvbench.slo",),
    ("kvbench.lab", "kvbench.report"),
    ("kvbench.__main__", "kvbench.results"),  # the dispatcher and the users' facade
)


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the layer entry it belongs to): the longest matching entry wins."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or (name != "kvbench" and module.startswith(name + ".")):
                if best is None or len(name) > len(best[1]):
                    best = (i, name)
    if best is None:
        return 0, "kvbench"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """kvbench modules one file imports; `from pkg import mod` counts as importing pkg.mod."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvbench")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "kvbench":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, known) for f in files}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        mine, my_entry = layer_of(mod)
        for dep in deps:
            theirs, their_entry = layer_of(dep)
            if theirs > mine or (theirs == mine and their_entry != my_entry
                                  and their_entry != "kvbench" and my_entry != "kvbench"):
                bad.append(f"{mod} (layer {mine}) imports {dep} (layer {theirs})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_kvbench_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_layer_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_every_package_init_says_what_it_owns_and_may_import():
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init} has no docstring"
    for pkg in ("p2p", "records", "fit", "plan", "slo", "report"):
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
        assert "import" in doc, f"kvbench/{pkg}/__init__.py does not say what it may import"


@pytest.mark.parametrize("planted, finds", [
    ({"kvbench.records.write": {"kvbench.fit.data"}, "kvbench.fit.data": set()}, "upward"),
    ({"kvbench.lab.x": {"kvbench.report.y"}, "kvbench.report.y": set()}, "upward"),
    ({"kvbench.fit.a": {"kvbench.fit.b"}, "kvbench.fit.b": {"kvbench.fit.a"}}, "cycle"),
])
def test_the_checker_catches_planted_faults(planted, finds):
    if finds == "upward":
        assert upward_imports(planted)
    else:
        assert cycles(planted) == [["kvbench.fit.a", "kvbench.fit.b"]]


def test_the_checker_reads_lazy_imports(tmp_path):
    pkg = tmp_path / "kvbench"
    (pkg / "records").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""x"""\n')
    (pkg / "records" / "__init__.py").write_text('"""x"""\n')
    (pkg / "records" / "w.py").write_text("def f():\n    from kvbench.plan import floors\n")
    (pkg / "plan").mkdir()
    (pkg / "plan" / "__init__.py").write_text('"""x"""\n')
    (pkg / "plan" / "floors.py").write_text("")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        bad = upward_imports(import_graph(pkg))
    finally:
        ROOT = saved
    assert bad == ["kvbench.records.w (layer 1) imports kvbench.plan.floors (layer 6)"]


# ---------------------------------------------------------------------------
# libraries never import the command plumbing

LIBRARIES = ("kvbench.records", "kvbench.fit", "kvbench.plan")


def cli_importers(graph: dict[str, set[str]]) -> list[str]:
    """Library modules (records, fit, plan) that import kvbench.cli: only a package's own
    command module (its cli.py) may; the errors and bounded numbers come from kvbench.errors."""
    return sorted(f"{mod} imports kvbench.cli" for mod, deps in graph.items()
                  if "kvbench.cli" in deps and mod.startswith(LIBRARIES) and not mod.endswith(".cli"))


def test_no_library_module_imports_the_cli():
    assert cli_importers(import_graph()) == []


def test_the_cli_check_catches_a_planted_import(tmp_path):
    pkg = tmp_path / "kvbench"
    (pkg / "records").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "records" / "__init__.py"):
        init.write_text('"""x"""\n')
    (pkg / "cli.py").write_text("")
    (pkg / "records" / "w.py").write_text("from kvbench.cli import UsageError\n")
    (pkg / "records" / "ok.py").write_text("from kvbench.errors import UsageError\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        graph = import_graph(pkg)
    finally:
        ROOT = saved
    assert cli_importers(graph) == ["kvbench.records.w imports kvbench.cli"]
