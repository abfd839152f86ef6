"""The transports' declarations (kvbench.p2p.transports.base.Transport's hooks), read as the
rest of kvbench reads them, and `kvbench p2p --help` at most 40 options (issue 41 items 1, 4).

The planted-transport test (test_planted_transport.py) shows a new module is picked up; these
show the installed ones declare what their records say, that the declarations load without
torch or mpi4py, and that the help hides no flag from the parser."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from kvbench.kv.cut import Cut, count_pieces
from kvbench.model import get_dtype, resolve_model
from kvbench.p2p import transports
from kvbench.p2p.args import build_parser
from tests.conftest import ROOT

OPTION = re.compile(r"^  -", re.M)  # an option's first line in argparse's help


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ended:
        build_parser().parse_args([*argv, "--help"])
    assert ended.value.code == 0
    return capsys.readouterr().out


def test_p2p_help_lists_at_most_40_options_and_the_link_flags_first(capsys):
    text = help_text(capsys)
    assert len(OPTION.findall(text)) <= 40, len(OPTION.findall(text))
    first = text[:text.index("\ntiming:")]  # the first groups: what moves, how it moves
    for flag in ("--sizes", "--bytes", "--model", "--transport", "--pattern", "--granularity"):
        assert flag in first
    assert "--nixl-op" not in text and "--nixl-engine-profile" not in text and "--mooncake-" not in text
    for name in transports.available():
        assert re.search(rf"^  transport {name} +(no flags|\d+ flags?: kvbench p2p --transport {name} --help)",
                         text, re.M), name


def test_a_chosen_transport_lists_its_own_flags(capsys):
    nixl = help_text(capsys, "--transport", "nixl")
    for flag in ("--nixl-op", "--nixl-engine-profile", "--nixl-reregister", "--nixl-batch"):
        assert flag in nixl
    assert "--mooncake-op" not in nixl
    assert "--mooncake-op" in help_text(capsys, "--transport=mooncake")
    layer = help_text(capsys, "--pattern", "sequential,layerwise")
    assert "layerwise pattern" in layer and "--nixl-op" not in layer


def test_every_flag_still_parses_whatever_the_help_lists():
    """The help hides groups; the parser keeps every flag (none suppressed for good)."""
    p = build_parser()
    hidden = [a for acts in p.owned.values() for a in acts if a.help != argparse.SUPPRESS]
    assert len(hidden) > 20  # the transports' and patterns' own flags (30 once NIXL's engine knobs became a profile)
    p.format_help()
    assert all(a.help != argparse.SUPPRESS for a in hidden)  # restored after the help
    args = p.parse_args(["--transport", "mpi", "--nixl-op", "read", "--ipc-mode", "write",
                         "--layer-compute", "model"])
    assert (args.nixl_op, args.ipc_mode, args.layer_compute) == ("read", "write", "model")


def test_the_declarations_load_without_torch_or_mpi4py():
    """The fit, matrix, plan and report read them on installs without the p2p extra."""
    code = ("import sys; from kvbench.p2p import transports as t; names = sorted(t.available()); "
            "print(names, sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("['gloo', 'ipc', 'mooncake', 'mpi', 'nccl', 'nixl'] []"), r.stdout


def committed_records() -> list[dict]:
    out = []
    paths = [*(ROOT / "tests" / "data").rglob("*.jsonl"), *(ROOT / "results").rglob("*.jsonl")]
    for path in sorted(paths):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("schema") == "kvbench.p2p/1":
                out.append(rec)
    return out


# what older kvbench wrote under NIXL's prefix and no longer does (the descriptor counts are
# descriptors_merged[_expected] now, K/V pages and block ids the cut's: kvbench.kv.cut)
OLDER_NAMES = {"nixl_desc_count", "nixl_expected_desc_count", "nixl_kv", "nixl_blocks"}


def undeclared(recs: list[dict]) -> list[str]:
    """Fields under a transport's prefix that it does not declare (record_field_names)."""
    bad = []
    for rec in recs:
        cls = transports.declared(rec["transport"])
        mine = {k for k in rec if k.startswith(f"{rec['transport']}_")} - OLDER_NAMES
        bad += sorted(f"{rec['transport']}: {k}" for k in mine - set(cls.record_field_names))
    return sorted(set(bad))


def unknown_ipc(recs: list[dict]) -> list[str]:
    """ipc records whose link reads `unknown` (the bug that started this: ipc was added
    while the link module branched on names, and nobody added its branch)."""
    return [str(r["transport_info"]) for r in recs
            if r["transport"] == "ipc" and transports.classify_record(r).label == "unknown"]


def test_committed_records_read_as_their_transports_declare():
    recs = committed_records()
    assert {"nixl", "ipc", "mpi", "gloo"} <= {r["transport"] for r in recs}
    assert undeclared(recs) == []
    assert unknown_ipc(recs) == []


@pytest.mark.parametrize("fault", ["nixl forgets nixl_op", "ipc declares no link"])
def test_the_declaration_checks_catch_a_planted_fault(monkeypatch, fault):
    recs = committed_records()
    if fault == "nixl forgets nixl_op":
        cls = transports.declared("nixl")
        monkeypatch.setattr(cls, "record_field_names",
                            tuple(n for n in cls.record_field_names if n != "nixl_op"))
        assert undeclared(recs) == ["nixl: nixl_op"]
    else:
        from kvbench.p2p.transports.base import Transport

        monkeypatch.setattr(transports.declared("ipc"), "link_path", Transport.link_path)
        assert len(unknown_ipc(recs)) == sum(r["transport"] == "ipc" for r in recs) > 0


@pytest.mark.parametrize("transport, joined", [("ipc", True), ("mpi", False), ("nixl", False),
                                               ("toy-not-installed", False)])
def test_descriptors_are_counted_as_the_transport_declares(transport, joined):
    model, dtype = resolve_model("llama-3.1-8b", None), get_dtype("bf16")
    cut = Cut(16, "joint", "contiguous", (1, 1))
    cls = transports.declared(transport)
    want = count_pieces(model, dtype, 2000, cut, merge_adjacent=joined)
    got = count_pieces(model, dtype, 2000, cut) if cls is None else cls.descriptors(model, dtype, 2000, cut)
    assert got == want
