"""ruff covers scripts/ (issue 41 item 6): every Python program there is linted by `make lint`,
`make check` and `make test`, although scripts/gpu-check and scripts/gpu-wheels have no .py
suffix (ruff skips such a file, even named on its command line, unless pyproject's
extend-include names it)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.skip("ruff is not installed (the 'test' extra)")
    return subprocess.run([sys.executable, "-m", "ruff", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def python_programs() -> list[str]:
    """scripts/'s Python: a .py file, or a file whose first line runs python."""
    found = []
    for path in sorted((ROOT / "scripts").iterdir()):
        if not path.is_file():
            continue
        first = path.read_bytes()[:100].split(b"\n", 1)[0].decode(errors="replace")
        if path.suffix == ".py" or re.match(r"#!.*\bpython[0-9.]*\b", first):
            found.append(path.relative_to(ROOT).as_posix())
    return found


def test_scripts_holds_python_programs():
    assert "scripts/gpu-check" in python_programs()


def test_ruff_lints_every_python_program_in_scripts():
    res = _ruff("check", "--show-files", "scripts")
    assert res.returncode == 0, res.stderr
    linted = {ln.strip().removeprefix(str(ROOT) + "/") for ln in res.stdout.splitlines()}
    assert set(python_programs()) <= linted, (python_programs(), res.stdout)


def test_ruff_check_scripts_passes():
    res = _ruff("check", "scripts")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-1000:]


def test_every_lint_target_lints_scripts():
    makefile = (ROOT / "Makefile").read_text()
    paths = re.search(r"^LINT_PATHS\s*=\s*(.+)$", makefile, re.M)
    assert paths and "scripts" in paths[1].split()
    calls = re.findall(r"ruff check (.+)$", makefile, re.M)
    assert calls and all(c.strip() == "$(LINT_PATHS)" for c in calls), calls
