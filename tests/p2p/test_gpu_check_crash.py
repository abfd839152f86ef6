"""scripts/gpu-check tells an upstream crash at interpreter exit (a child that wrote its result,
then died by SIGSEGV, as nixl-cu13's UCX does with libibverbs1 and no RDMA device: issue 42)
apart from a failed check: one line naming the kept result. Planted: each child below writes
its result and then kills itself with SIGSEGV from an atexit hook; the same crash without a
result, or with a wrong byte in it, stays a failure."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.conftest import PY
from tests.p2p.gpu_script import execute, gc

CRASH_AT_EXIT = "import atexit, os, signal; atexit.register(lambda: os.kill(os.getpid(), signal.SIGSEGV))\n"


def crashing_step(name: str, wrong: int | None):
    """A step that writes one record (none when wrong is None), then dies by SIGSEGV at exit."""
    write = ("" if wrong is None else
             "import json, sys; open(sys.argv[1] + '/kvbench-p2p-" + name + ".jsonl', 'w').write("
             f"json.dumps({{'pattern': 'sequential', 'bytes': 1024, 'wrong': {wrong}}}) + '\\n')\n")
    return lambda o: gc.Step(name, 30, [PY, "-c", CRASH_AT_EXIT + write, str(o)])


def test_a_step_that_wrote_its_result_then_crashed_is_kept_and_named(tmp_path):
    out = tmp_path / "a"
    assert execute(tmp_path, lambda o: [crashing_step("seg", 0)(o)], out) == 0
    commands = (out / "commands.txt").read_text()
    (line,) = [ln for ln in commands.splitlines() if "died by" in ln]
    assert ("ok, then died by SIGSEGV at exit" in line and "kvbench-p2p-seg.jsonl (1 records, "
            "wrong == 0)" in line and "the crash came after it" in line)
    assert "FAILED" not in commands and "failed steps: none" in (out / "summary.md").read_text()
    assert (out / "kvbench-p2p-seg.jsonl").exists()


@pytest.mark.parametrize("wrong", [None, 3])
def test_the_same_crash_without_a_clean_result_is_a_failure(tmp_path, wrong):
    out = tmp_path / "b"
    assert execute(tmp_path, lambda o: [crashing_step("seg", wrong)(o)], out) == 1
    commands = (out / "commands.txt").read_text()
    assert "FAILED (exit -11" in commands and "died by" not in commands


def wrapper(tmp_path: Path, before: str) -> str:
    """A 'python' that runs gpu-check's probe with `before` run first (an atexit hook, or a
    crash before the probe answers)."""
    path = tmp_path / "python-crashing"
    boot = before + "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    path.write_text(f"#!/bin/sh\nexec {PY} -c \"{boot}\" \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_preflight_uses_an_answer_written_before_the_crash_and_says_so(tmp_path, capsys):
    setup = gc.Setup(wrapper(tmp_path, CRASH_AT_EXIT.replace("\n", "; ")), gc.base_env())
    got = gc.run_probe(setup, "cpu", False)
    said = got["facts"]["import check"]
    assert said.startswith("answered, then died by SIGSEGV at interpreter exit")
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "died by" in ln]
    assert "not a failed check" in line and "its answer is used" in line


def test_preflight_refuses_a_crash_before_the_answer(tmp_path):
    crash_first = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV); "
    setup = gc.Setup(wrapper(tmp_path, crash_first), gc.base_env())
    with pytest.raises(gc.Refused, match="the interpreter's import check exited -11"):
        gc.run_probe(setup, "cpu", False)
    assert os.path.exists(setup.python)
