"""The tests' own layout: a test module imports helpers from helper modules (tests/helpers.py,
tests/fuzzing.py, tests/<component>/helpers.py, tests/conftest.py), never from another test
module, and reaches kvbench through its public names, never a `_`-prefixed one.

Why: a test module that imports another runs the other's module-level set-up and ties two
test files so that moving or renaming one breaks the other; a private name is one kvbench may
change without notice, so a test that imports it pins an implementation, not a behaviour.
The walk reads the source (ast), so a file added later is covered; each rule is proven on a
planted file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Private kvbench names a test may import: none (each one a test needed was made public).
# The list may only shrink: an entry no test needs any more fails below.
PRIVATE_LEFT: set[tuple[str, str]] = set()  # none left: every name a test imports is public


def _is_test_module(dotted: str) -> bool:
    return dotted.split(".")[0] == "tests" and dotted.rsplit(".", 1)[-1].startswith("test_")


def _private(dotted: str) -> bool:
    """A `_name` anywhere in the path; dunders (`kvbench.__main__`) are public."""
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
               for p in dotted.split(".")[1:])


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a module imports: `from a.b import c` gives a.b.c."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)]
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
    return out


def problems(root: Path, allowed=frozenset()) -> tuple[list[str], set[tuple[str, str]]]:
    """Imports under root/tests that break the rules, and the allowed private ones still used."""
    bad, used = [], set()
    for path in sorted((root / "tests").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("tests/data/"):
            continue
        for line, name in imported(ast.parse(path.read_text(), rel)):
            if _is_test_module(name):
                bad.append(f"{rel}:{line}: imports the test module {name}")
            elif name.split(".")[0] == "kvbench" and _private(name):
                if (rel, name) in allowed:
                    used.add((rel, name))
                elif not any(name.startswith(f"{a}.") for r, a in allowed if r == rel):
                    bad.append(f"{rel}:{line}: imports the private kvbench name {name}")
    return sorted(set(bad)), used


def test_no_test_imports_a_test_module_or_a_private_kvbench_name():
    bad, used = problems(ROOT, PRIVATE_LEFT)
    assert bad == [], "\n".join(bad)
    assert used == PRIVATE_LEFT, f"no longer imported, drop from PRIVATE_LEFT: {PRIVATE_LEFT - used}"


FROM = "from "  # split: the git grep for test-module imports must not find these plants


@pytest.mark.parametrize("source, says", [
    (FROM + "tests.test_robust import run\n", "imports the test module tests.test_robust"),
    (FROM + "tests.p2p import test_engine\n", "imports the test module tests.p2p.test_engine"),
    ("import tests.fit.test_fit\n", "imports the test module tests.fit.test_fit"),
    ("def f():\n    " + FROM + "tests.plan.test_plan import bad\n", "imports the test module tests.plan.test_plan"),
    ("from kvbench.fit.stats import _weighted_medians\n", "private kvbench name kvbench.fit.stats._weighted_medians"),
    ("from kvbench.p2p.transports import _ipc_mem\n", "private kvbench name kvbench.p2p.transports._ipc_mem"),
    ("import kvbench.p2p._private.mod\n", "private kvbench name kvbench.p2p._private"),
    ("from kvbench.p2p.__main__ import _main\n", "private kvbench name kvbench.p2p.__main__._main"),
])
def test_a_planted_import_is_found(tmp_path, source, says):
    (tmp_path / "tests" / "x").mkdir(parents=True)
    (tmp_path / "tests" / "x" / "test_planted.py").write_text(source)
    bad, _ = problems(tmp_path)
    assert len(bad) >= 1 and all(b.startswith("tests/x/test_planted.py:") for b in bad), bad
    assert any(says in b for b in bad), bad


def test_helper_modules_and_public_names_pass(tmp_path):
    (tmp_path / "tests" / "fit").mkdir(parents=True)
    (tmp_path / "tests" / "fit" / "test_ok.py").write_text(
        "from __future__ import annotations\nfrom tests.helpers import run\n"
        "from tests.fit.helpers import fit\nfrom tests.conftest import ROOT\n"
        "from kvbench.fit.stats import weighted_medians\nimport kvbench.p2p.cli\n")
    assert problems(tmp_path) == ([], set())


def test_an_allowed_private_name_is_only_allowed_where_listed(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from kvbench.plan.twohop import _series\n")
    (tmp_path / "tests" / "test_b.py").write_text("from kvbench.plan.twohop import _series\n")
    allowed = {("tests/test_a.py", "kvbench.plan.twohop._series")}
    bad, used = problems(tmp_path, allowed)
    assert used == allowed and bad == ["tests/test_b.py:1: imports the private kvbench name "
                                       "kvbench.plan.twohop._series"]
