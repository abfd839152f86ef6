"""The package layout keeps data flowing one way: measure -> record -> fit -> plan -> decide.

Walks every import statement of kvbench (module level and inside functions: a lazy import
is still a dependency) and fails on an import cycle between modules, on a lower layer
importing a higher one, or on a module of kvbench/lab/venv (it runs inside the lab's own
vLLM venv) importing kvbench outside lab.venv. The checkers themselves are proven on
planted graphs and planted source trees.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvbench"

# Lowest first. A module may import its own layer's package and anything below.
LAYERS = (
    ("kvbench", "kvbench.units", "kvbench.cli"),  # kvbench.errors: under "kvbench", below all
    ("kvbench.records",),
    ("kvbench.kv",),  # the torch-free KV vocabulary: geometry (tokens -> bytes), cut, shards
    ("kvbench.model",),  # presets, HF configs, the floor table: sizes KV with kvbench.kv
    ("kvbench.links",),  # the torch-free link vocabulary: kinds, causes, NCCL/UCX logs
    ("kvbench.p2p",),
    ("kvbench.fit",),
    ("kvbench.matrix",),
    ("kvbench.plan",),
    ("kvbench.slo",),
    # the lab, lowest first: what runs in its own venv, the plan's lab section, load and
    # reference fits, the serving stack, the commands; the lab CLI on top of them all
    ("kvbench.lab.venv",),
    ("kvbench.lab.config",),
    ("kvbench.lab.planfile",),
    ("kvbench.lab.load",),
    ("kvbench.lab.stack",),
    ("kvbench.lab.sweep", "kvbench.lab.faults"),
    ("kvbench.lab.agree",),
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


def module_name(path: Path, root: Path | None = None) -> str:
    parts = list(path.relative_to((root or ROOT).parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str], root: Path | None = None,
               top_level_only: bool = False) -> set[str]:
    """kvbench modules one file imports; `from pkg import mod` counts as importing pkg.mod.
    top_level_only: only the imports run when the module itself is imported."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in (tree.body if top_level_only else ast.walk(tree)):
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
    known = {module_name(f, root) for f in files}
    return {module_name(f, root): imports_of(f, known, root) for f in files}


VENV = "kvbench.lab.venv"


def venv_leaks(root: Path = ROOT) -> list[str]:
    """What the lab-venv modules would drag into the lab venv: any import (lazy ones too) of
    kvbench outside lab.venv, and any module-level kvbench import of a package __init__ that
    `python -m kvbench.lab.venv.X` runs on the way (kvbench, kvbench.lab)."""
    files = sorted(root.rglob("*.py"))
    known = {module_name(f, root) for f in files}
    bad = []
    for f in files:
        mod = module_name(f, root)
        if mod == VENV or mod.startswith(VENV + "."):
            deps = imports_of(f, known, root)
        elif f.name == "__init__.py" and VENV.startswith(mod + "."):
            deps = imports_of(f, known, root, top_level_only=True)
        else:
            continue
        bad += [f"{mod} imports {d}" for d in sorted(deps)
                if d != VENV and not d.startswith(VENV + ".")]
    return bad


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


def test_lab_venv_modules_import_no_kvbench():
    assert (ROOT / "lab" / "venv" / "proxy.py").exists()  # the rule still looks where they are
    assert venv_leaks() == []


@pytest.mark.parametrize("where, source, finds", [
    ("lab/venv/proxy.py", "def main():\n    from kvbench.cli import UsageError\n",
     "kvbench.lab.venv.proxy imports kvbench.cli"),
    ("lab/venv/client.py", "import kvbench.records.write\n",
     "kvbench.lab.venv.client imports kvbench.records.write"),
    ("lab/__init__.py", "from kvbench.lab.stack import env\n", "kvbench.lab imports kvbench.lab.stack.env"),
])
def test_the_venv_checker_catches_a_planted_import(tmp_path, where, source, finds):
    """The real tree copied, one planted import added: the checker names it, and only it."""
    import shutil

    root = tmp_path / "kvbench"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert venv_leaks(root) == []
    target = root / where
    target.write_text(target.read_text() + "\n" + source)
    assert venv_leaks(root) == [finds]


def test_every_package_init_says_what_it_owns_and_may_import():
    for init in ROOT.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc, f"{init} has no docstring"
    for pkg in ("kv", "links", "p2p", "records", "fit", "plan", "slo", "report"):
        doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
        assert "import" in doc, f"kvbench/{pkg}/__init__.py does not say what it may import"


@pytest.mark.parametrize("planted, finds", [
    ({"kvbench.records.write": {"kvbench.fit.data"}, "kvbench.fit.data": set()}, "upward"),
    ({"kvbench.kv.cut": {"kvbench.model"}, "kvbench.model": set()}, "upward"),
    ({"kvbench.lab.x": {"kvbench.report.y"}, "kvbench.report.y": set()}, "upward"),
    ({"kvbench.lab.sweep.main": {"kvbench.lab.cli"}, "kvbench.lab.cli": set()}, "upward"),
    ({"kvbench.lab.load.bench": {"kvbench.lab.stack.deploy"}, "kvbench.lab.stack.deploy": set()}, "upward"),
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
    bad = upward_imports(import_graph(pkg))
    assert bad == ["kvbench.records.w (layer 1) imports kvbench.plan.floors (layer 8)"]


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


# ---------------------------------------------------------------------------
# one contract per file format (docs/contracts.md)

CONTRACTS = "kvbench.records.schema"  # the package every format's one class lives in
VERSION = re.compile(r"kvbench\.(p2p|fit|plan|route|kv-transfer-model|matrix|slo\.[a-z-]+|lab\.[a-z-]+)/[0-9]+")
CONTRACT_CALLS = {"contract_dump", "as_contract", "parse"}
# format -> (the module that writes it, its writing function, the class it writes through)
WRITERS = {
    "kvbench.p2p/1": ("kvbench.p2p.assemble", "make_record", "P2PRecord"),
    "kvbench.fit/2": ("kvbench.fit.fitting", "fit_document", "FitDocument"),
    "kvbench.plan/1": ("kvbench.plan.cli", "plan_main", "PlanDocument"),
    "kvbench.route/1": ("kvbench.plan.cli", "route_main", "RouteDocument"),
    "kvbench.kv-transfer-model/1": ("kvbench.plan.export", "kv_transfer_model", "KVTransferModel"),
    "kvbench.matrix/1": ("kvbench.matrix.analyze", "analyze", "MatrixDocument"),
    "kvbench.slo.request/1": ("kvbench.records.requests", "record_to_json", "RequestIn"),
    "kvbench.slo.metrics/1": ("kvbench.slo.scrape", "run_scrape", "ScrapeHeader"),
    "kvbench.slo.report/1": ("kvbench.slo.cli", "cmd_analyze", "SloReport"),
    "kvbench.lab.sweep/1": ("kvbench.lab.sweep.main", "open_out", "SweepMeta"),
    "kvbench.lab.sweep-report/2": ("kvbench.lab.sweep.report", "write_report", "SweepReport"),
    "kvbench.lab.faults/1": ("kvbench.lab.faults.main", "main", "FaultsReport"),
    "kvbench.lab.agree/1": ("kvbench.lab.agree.main", "main", "AgreeDocument"),
}
# modules that build a format's document as a dict before their writer validates it, and
# kvbench.fit.sim, whose simulated records only ever go to the fit in memory (never a file)
DICT_BUILDERS = {m for m, _, _ in WRITERS.values()} | {"kvbench.fit.sim"}


def _modules(root: Path) -> dict[str, ast.Module]:
    """Every module under root (a kvbench tree: the real one or a planted copy), parsed."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(f.read_text())
    return out


def _schema_constants(trees: dict[str, ast.Module]) -> set[str]:
    """Names the contract modules give the version strings (SCHEMA_FIT, ...)."""
    names = set()
    for mod, tree in trees.items():
        if mod.startswith(CONTRACTS):
            for node in ast.walk(tree):
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str) and VERSION.fullmatch(node.value.value)):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def untyped_writers(root: Path = ROOT) -> list[str]:
    """Where a file format is written without its contract: a version string spelled out
    outside kvbench.records.schema, or a {"schema": SCHEMA_...} document built in a module
    that is not the format's writer."""
    trees = _modules(root)
    consts, bad = _schema_constants(trees), []
    for mod, tree in trees.items():
        if mod.startswith(CONTRACTS):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and VERSION.fullmatch(node.value)):
                bad.append(f"{mod}:{node.lineno}: the version string {node.value!r} outside {CONTRACTS}")
            if isinstance(node, ast.Dict) and mod not in DICT_BUILDERS:
                for k, v in zip(node.keys, node.values, strict=True):
                    if (isinstance(k, ast.Constant) and k.value == "schema"
                            and isinstance(v, ast.Name) and v.id in consts):
                        bad.append(f"{mod}:{node.lineno}: a {v.id} document built outside its writer")
    return sorted(bad)


def writers_off_contract(root: Path = ROOT) -> list[str]:
    """Each format: exactly one class in kvbench.records.schema declares its version string,
    and its writer's function passes that class to contract_dump / as_contract / parse."""
    trees, bad = _modules(root), []
    for version, (mod, func, cls) in WRITERS.items():
        owners = [f"{m}.{c.name}" for m, t in trees.items() if m.startswith(CONTRACTS)
                  for c in ast.walk(t) if isinstance(c, ast.ClassDef)
                  and any(isinstance(n, ast.Constant) and n.value == version for n in ast.walk(c))]
        if [o.rsplit(".", 1)[1] for o in owners] != [cls]:
            bad.append(f"{version}: declared by {owners or 'no class'}, expected one class {cls}")
        fn = next((n for n in ast.walk(trees.get(mod, ast.Module(body=[], type_ignores=[])))
                   if isinstance(n, ast.FunctionDef) and n.name == func), None)
        through = fn is not None and any(
            isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) in CONTRACT_CALLS
            and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == cls for n in ast.walk(fn))
        if not through:
            bad.append(f"{version}: {mod}.{func} does not write through {cls}")
    return bad


def test_every_format_is_written_and_read_through_one_contract():
    assert untyped_writers() == []
    assert writers_off_contract() == []


def _copy_of_kvbench(tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "kvbench"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_a_planted_untyped_writer_is_caught(tmp_path):
    """A second writer of the fit format that builds the dict by hand, with the version
    string spelled out or with the contract's own constant, fails the check."""
    pkg = _copy_of_kvbench(tmp_path)
    (pkg / "report" / "refit.py").write_text(
        "import json\n\n\ndef write(path, groups):\n"
        "    path.write_text(json.dumps({'schema': 'kvbench.fit/2', 'groups': groups}))\n")
    (pkg / "slo" / "refit2.py").write_text(
        "from kvbench.records.schema.fit import SCHEMA_FIT\n\n\n"
        "def doc(groups):\n    return {'schema': SCHEMA_FIT, 'groups': groups}\n")
    assert untyped_writers(pkg) == [
        "kvbench.report.refit:5: the version string 'kvbench.fit/2' outside kvbench.records.schema",
        "kvbench.slo.refit2:5: a SCHEMA_FIT document built outside its writer"]


def test_the_version_check_covers_the_slo_and_lab_formats(tmp_path):
    """Every format kvbench writes is in WRITERS, and a slo or lab version string spelled out
    (or its constant used) outside its contract and writer is caught: these were outside the
    check's pattern before."""
    assert {v.split("/")[0] for v in WRITERS} >= {
        "kvbench.slo.request", "kvbench.slo.metrics", "kvbench.slo.report", "kvbench.lab.sweep",
        "kvbench.lab.sweep-report", "kvbench.lab.faults", "kvbench.lab.agree"}
    pkg = _copy_of_kvbench(tmp_path)
    faults = pkg / "lab" / "faults" / "main.py"
    faults.write_text(faults.read_text().replace('"schema": SCHEMA_FAULTS,',
                                                 '"schema": "kvbench.lab.faults/1",'))
    (pkg / "report" / "rescrape.py").write_text(
        "from kvbench.records.schema.slo import SCHEMA_METRICS\n\n\n"
        "def head():\n    return {'kind': 'header', 'schema': SCHEMA_METRICS}\n")
    (pkg / "lab" / "again.py").write_text("SCHEMA = 'kvbench.lab.sweep-report/2'\n")
    bad = untyped_writers(pkg)
    assert [b.split(":")[0] for b in bad] == [
        "kvbench.lab.again", "kvbench.lab.faults.main", "kvbench.report.rescrape"], bad
    assert "'kvbench.lab.faults/1' outside kvbench.records.schema" in bad[1]
    assert "a SCHEMA_METRICS document built outside its writer" in bad[2]
    scrape = pkg / "slo" / "scrape.py"
    scrape.write_text(scrape.read_text().replace("as_contract(ScrapeHeader, head,", "print(head,"))
    assert writers_off_contract(pkg) == [
        "kvbench.slo.metrics/1: kvbench.slo.scrape.run_scrape does not write through ScrapeHeader"]


def test_a_writer_that_stops_using_its_contract_is_caught(tmp_path):
    pkg = _copy_of_kvbench(tmp_path)
    fitting = pkg / "fit" / "fitting.py"
    fitting.write_text(fitting.read_text().replace("return contract_dump(FitDocument, {",
                                                   "return untyped_dump({"))
    schema = pkg / "records" / "schema" / "plan.py"
    schema.write_text(schema.read_text() + "\n\nclass PlanAgain(Open):\n"
                      "    schema_: Literal['kvbench.plan/1'] = Field(alias='schema')\n")
    assert writers_off_contract(pkg) == [
        "kvbench.fit/2: kvbench.fit.fitting.fit_document does not write through FitDocument",
        "kvbench.plan/1: declared by ['kvbench.records.schema.plan.PlanDocument', "
        "'kvbench.records.schema.plan.PlanAgain'], expected one class PlanDocument"]
