"""Path errors, signals and one-line errors as a user meets them (issue 25, groups 3, 9, 10, 12).

Group 3 runs the commands as a non-root user: root reads and writes through any permission,
so only another user sees EACCES. As root the commands are re-run under
`setpriv --reuid=nobody --regid=nogroup --clear-groups`; as a non-root user they run as they
are; a root without setpriv skips with the reason. Every case must end with exit 2, exactly
one stderr line and no traceback, and leave no file behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, default_signals
from tests.helpers import ANALYZE, LLAMA, cohort_lines

P2P = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"
FIT = ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json"


def _non_root_prefix() -> list[str] | None:
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return None if setpriv is None else [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def kvbench(*argv, prefix=(), cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "kvbench", *map(str, argv)], cwd=cwd or ROOT,
                          capture_output=True, text=True, timeout=timeout)


def one_line(p: subprocess.CompletedProcess, *fragments: str, code: int = 2) -> str:
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for f in fragments:
        assert f in p.stderr, (f, p.stderr)
    return p.stderr


@pytest.fixture(scope="module")
def shared():
    """A world-readable folder: inputs, an unsearchable folder (root's, mode 0600), a folder
    holding an unreadable file and one holding an unreadable folder."""
    base = Path(tempfile.mkdtemp(prefix="kvbench-paths-"))
    try:
        base.chmod(0o777)
        (base / "config.json").write_text(json.dumps(LLAMA))
        (base / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
        shutil.copy(P2P, base / "p.jsonl")
        shutil.copy(FIT, base / "f.json")
        locked = base / "locked"
        locked.mkdir()
        shutil.copy(P2P, locked / "p.jsonl")
        (locked / "r.jsonl").write_text((base / "r.jsonl").read_text())
        locked.chmod(0o600)
        for name, hidden in (("bad-file", "p.jsonl"), ("bad-folder", "sub")):
            d = base / name
            d.mkdir()
            shutil.copy(P2P, d / "ok.jsonl")
            target = d / hidden
            if hidden == "sub":
                target.mkdir()
                shutil.copy(P2P, target / "p.jsonl")
            else:
                shutil.copy(P2P, target)
            target.chmod(0o000)
        for p in base.rglob("*"):
            if p.is_file() and p.parent == base:
                p.chmod(0o644)
        yield base
    finally:
        for p in [base, *base.rglob("*")]:
            try:
                p.chmod(0o777)
            except OSError:
                pass
        shutil.rmtree(base, ignore_errors=True)


LOCKED_CASES = [
    ("model --model-config {b}/config.json --out {b}/locked/m.json", "cannot write"),
    ("slo synth sweep --rates 1 --duration-s 1 --out {b}/locked/s.jsonl", "cannot write"),
    ("slo analyze {b}/locked/r.jsonl " + " ".join(ANALYZE), "cannot read"),
    ("slo analyze {b}/r.jsonl --out {b}/locked/a.json " + " ".join(ANALYZE), "cannot write"),
    ("slo scrape d=http://127.0.0.1:9/metrics --duration 1 --out {b}/locked/m.jsonl", "cannot write"),
    ("fit {b}/locked/p.jsonl", "cannot read"),
    ("fit {b}/p.jsonl --out {b}/locked/f.json", "cannot write"),
    ("plan export --fit {b}/f.json --to json --out {b}/locked/e.json", "cannot write"),
    ("plan --fit {b}/locked/f.json --prompt-tokens 1000", "cannot read"),
    ("report {b}/locked", "cannot write"),
    ("report {b}/bad-file --out {b}/rep1", "Permission denied"),
    ("report {b}/bad-folder --out {b}/rep2", "Permission denied"),
]


@pytest.mark.parametrize("case, fragment", LOCKED_CASES, ids=[c.split(" {")[0] + f"-{i}"
                                                              for i, (c, _) in enumerate(LOCKED_CASES)])
def test_an_unsearchable_folder_is_one_line_as_a_non_root_user(shared, case, fragment):
    prefix = _non_root_prefix()
    if prefix is None:
        pytest.skip("running as root without setpriv: no non-root user to see EACCES")
    before = sorted(p.name for p in shared.iterdir())
    one_line(kvbench(*case.format(b=shared).split(), prefix=prefix, cwd=shared), fragment, "Permission denied")
    made = [p for p in shared.iterdir() if p.name not in before]
    assert [p.name for p in made] in ([], ["rep1"], ["rep2"])  # report's --out folder is made first
    assert not any(p.is_file() for d in made for p in d.rglob("*")), "a file was left behind"


LONG = "x" * 300


@pytest.mark.parametrize("case", [
    "model --model-config {b}/config.json --out {b}/" + LONG + ".json",
    "fit {b}/" + LONG + ".jsonl",
    "fit {b}/p.jsonl --out {b}/" + LONG + ".json",
    "slo analyze {b}/" + LONG + ".jsonl " + " ".join(ANALYZE),
    "slo synth sweep --rates 1 --duration-s 1 --out {b}/" + LONG + ".jsonl",
    "report {b}/" + LONG,
    "plan --fit {b}/" + LONG + ".json --prompt-tokens 1000",
])
def test_a_300_character_file_name_is_one_line(shared, case):
    one_line(kvbench(*case.format(b=shared).split()), "File name too long")


def test_out_that_is_empty_or_names_a_folder_is_refused(tmp_path):
    one_line(kvbench("model", "--model-config", tmp_path.parent / "x.json", "--out", ""), "--out: an empty path")
    one_line(kvbench("slo", "synth", "sweep", "--rates", "1", "--duration-s", "1", "--out", f"{tmp_path}/x/"),
             "names a folder")
    assert not (tmp_path / "x").exists()


def test_a_newline_in_a_path_stays_on_one_line(tmp_path):
    err = one_line(kvbench("fit", f"{tmp_path}/a\nb.jsonl"), "a\\nb.jsonl")
    assert "\nb.jsonl" not in err
    one_line(kvbench("no\nsuch"), "unknown command 'no\\nsuch'")


@pytest.mark.parametrize("sig, rc, word", [(signal.SIGINT, 130, "interrupted"),
                                            (signal.SIGTERM, 143, "terminated")])
def test_a_signal_during_synth_is_one_line_and_leaves_nothing(tmp_path, sig, rc, word):
    """The signal arrives while synth writes its temp file (the test waits for the temp to exist:
    readiness, not a sleep); the writer's `finally` removes it."""
    import time

    out = tmp_path / "s.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "slo", "synth", "sweep", "--rates", "2000",
                             "--duration-s", "300", "--out", str(out)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_signals)
    deadline = time.monotonic() + 120  # a hang bound, not a timing assertion
    while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc and err.count("\n") == 1 and word in err, err
    assert list(tmp_path.iterdir()) == []


SWALLOWED = """
import os, signal, sys, time
from kvbench.cli import run_main
from kvbench.records.write import new_file_stream

def work(argv):
    with new_file_stream(sys.argv[1]) as fh:
        try:  # what C code that clears a pending exception does to the handler's raise
            os.kill(os.getpid(), int(sys.argv[2]))
            time.sleep(1)
        except BaseException:
            pass
        for _ in range(600):  # ... and the command runs on
            fh.write("x\\n")
            time.sleep(0.1)
    return 0

sys.exit(run_main("kvbench test", work))
"""


@pytest.mark.parametrize("sig, rc, word", [(signal.SIGINT, 130, "interrupted"),
                                            (signal.SIGTERM, 143, "terminated")])
def test_a_swallowed_stop_signal_still_ends_the_command(tmp_path, sig, rc, word):
    """The backstop (kvbench.cli): a signal whose exception something swallowed still ends the
    command a few seconds later, with the same one line and status and no temp file."""
    out = tmp_path / "o.txt"
    p = subprocess.run([sys.executable, "-c", SWALLOWED, str(out), str(int(sig))], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, preexec_fn=default_signals)
    assert p.returncode == rc and p.stderr.count("\n") == 1 and word in p.stderr, p.stderr
    assert list(tmp_path.iterdir()) == []


SLOW_CLEAN_UP = """
import os, pathlib, signal, sys, time
from kvbench.cli import run_main

def work(argv):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    finally:  # a clean-up longer than the backstop's grace (stopping servers, say)
        time.sleep(7)
        pathlib.Path(sys.argv[1]).write_text("cleaned up")
    return 0

sys.exit(run_main("kvbench test", work))
"""


def test_the_backstop_leaves_a_long_clean_up_alone(tmp_path):
    marker = tmp_path / "done"
    p = subprocess.run([sys.executable, "-c", SLOW_CLEAN_UP, str(marker)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, preexec_fn=default_signals)
    assert p.returncode == 130 and "interrupted" in p.stderr, p.stderr
    assert marker.read_text() == "cleaned up"


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_outputs_follow_the_umask(tmp_path, mask, mode):
    """Group 12: every output was 0600 whatever the umask (mkstemp's mode kept by the link)."""
    out = tmp_path / "s.jsonl"
    p = subprocess.run(["sh", "-c", f'umask {mask:03o} && exec "$0" -m kvbench slo synth cohort --out "$1"',
                        sys.executable, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.stat().st_mode & 0o777 == mode


def test_analyze_out_and_plot_the_same_file_is_refused_before_the_work(tmp_path):
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    one_line(kvbench("slo", "analyze", tmp_path / "r.jsonl", *ANALYZE, "--out", tmp_path / "x.svg",
                     "--plot", tmp_path / "x.svg"), "same file as --out")
