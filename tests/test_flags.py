"""Every numeric flag of every command: bounded, ASCII digits only, refused in one line.

The class the third hostile round found one example of each: `--nixl-threads 100000`
segfaulted NIXL/UCX (exit 139), `--nixl-threads -1` was recorded, a huge
`--nixl-progress-delay-us` ended in two error lines (one per rank), `lab agree --repeats`
took '１２' (Python's int() reads other scripts' digits). Two checks cover the class:
no parser anywhere in kvbench takes a raw `type=int` or `type=float` (the source is read,
so a flag added later is covered), and every numeric flag type of every command's parser
refuses the hostile values (walked from the parsers themselves, subcommands included).

Also here, as the same surface: model, plan and slo flags bounded against infinity, NaN,
denormals and huge numbers (issue 15, list B), the one list/pair rule every list flag
follows (kvbench.errors), and every bounded numeric flag fuzzed with tests/fuzzing.py's
property. A command's own flag combinations are with its component (e.g.
tests/p2p/test_p2p_hostile_flags.py, tests/plan/test_plan_hostile_inputs.py).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvbench.fit.cli
import kvbench.lab.faults.main
import kvbench.lab.sweep.main
import kvbench.model
import kvbench.plan.cli
import kvbench.report.cli
import kvbench.slo.cli
from kvbench import errors
from kvbench.cli import UsageError
from tests.conftest import ROOT
from tests.fuzzing import (
    check,
    workdir,
)
from tests.helpers import ANALYZE, cohort_lines, refused, run

HOSTILE = ["１２", "nan", "inf", "-inf", "1e400", "9" * 30, "", " ", "0x10", "1_000", "12abc",
           "1e-320", "٣", "+", "--1"]
PARSERS = {  # command -> module with build_parser (p2p: every transport's flags included)
    "model": "kvbench.model", "fit": "kvbench.fit.cli", "report": "kvbench.report.cli",
    "plan": "kvbench.plan.cli", "lab": "kvbench.lab.cli",
    "lab agree": "kvbench.lab.agree.main", "faults": "kvbench.lab.faults.main",
    "sweep": "kvbench.lab.sweep.main",
    "slo": "kvbench.slo.cli", "p2p": "kvbench.p2p.args",
}


def _raw_number_types() -> list[str]:
    """add_argument(..., type=int|float) anywhere in kvbench (file:line)."""
    found = []
    for path in sorted((ROOT / "kvbench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for kw in node.keywords:
                    if kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_flag_takes_a_raw_int_or_float():
    """int('１２') is 12 and float('nan') is nan: every number goes through kvbench.cli's
    bounded parsers (arg_int, arg_float and the bounded_* functions)."""
    assert _raw_number_types() == []


@pytest.mark.parametrize("kind", [int, float])
def test_lab_venv_number_flags_refuse_the_hostile_values(kind):
    """The lab-venv modules (proxy, client, tiny-model builder) parse numbers without
    kvbench.cli (they import no kvbench outside lab.venv): the same values are refused."""
    from kvbench.lab.venv.args import number

    parse = number(kind, 0, 1e7, lo_open=True)
    for bad in HOSTILE + ["0", "-1", "1e8"]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    assert parse("12") == 12


def _parsers():
    for name, module in PARSERS.items():
        mod = importlib.import_module(module)
        build = mod.build_parser
        yield name, build(0) if name == "p2p" else build()
        if name == "plan":
            yield "plan route", mod.build_route_parser()
            yield "plan export", mod.build_export_parser()


def _numeric_actions() -> list[tuple[str, str, object]]:
    out = []

    def walk(parser, name):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(sp, f"{name} {sub}")
            elif a.option_strings and a.type is not None:
                out.append((name, a.option_strings[-1], a.type))

    for name, parser in _parsers():
        walk(parser, name)
    return out


NUMERIC = _numeric_actions()


def test_the_walk_finds_the_flags_the_round_named():
    flags = {(c, f) for c, f, _ in NUMERIC}
    assert {("p2p", "--iters"), ("p2p", "--timeout"), ("lab agree", "--repeats"),
            ("lab agree", "--p2p-iters"), ("slo analyze", "--attainment-min")} <= flags
    assert len(NUMERIC) > 40


@pytest.mark.parametrize("command, flag, parse", NUMERIC, ids=[f"{c}:{f}" for c, f, _ in NUMERIC])
def test_every_numeric_flag_refuses_hostile_values(command, flag, parse):
    for value in HOSTILE:
        with pytest.raises(argparse.ArgumentTypeError) as err:
            parse(value)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv, fragment", [
    (["--nixl-engine-profile", "vllm-0.32:threads=100000"],
     "argument --nixl-engine-profile: threads must be a non-negative integer (<= 256), got '100000'"),
    (["--nixl-engine-profile", "vllm-0.32:threads=-1"],
     "argument --nixl-engine-profile: threads must be a non-negative integer"),
    (["--nixl-engine-profile", "vllm-0.32:progress_delay_us=99999999999999999999"],
     "argument --nixl-engine-profile: progress_delay_us must be"),
    (["--debug-stop", "１:data-check"], "argument --debug-stop: expects RANK:PHASE"),
    (["--no-such-flag\nsecond line"], "unrecognized arguments: --no-such-flag\\nsecond line"),
])
def test_p2p_refuses_a_bad_flag_in_one_line_before_any_rank_starts(capsys, argv, fragment):
    """Parsed by every rank before MPI does anything with it; rank 0 alone prints."""
    from kvbench.p2p.args import build_parser

    for rank in (0, 1):
        with pytest.raises(SystemExit) as exit_:
            build_parser(rank).parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        if rank == 0:
            assert err.count("\n") == 1 and fragment in err, err
        else:
            assert err == ""


def test_byte_sizes_take_ascii_digits_only():
    from kvbench.units import parse_bytes

    assert parse_bytes("4K") == 4096 and parse_bytes(" 64 MiB ") == 64 << 20
    for bad in ("１２K", "٣M", "9" * 21, "1_0K", "-4K"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_lab_agree_refuses_non_ascii_repeats_and_rates_before_reading_the_plan(tmp_path):
    import kvbench.lab.agree.main

    for argv, fragment in ((["--repeats", "１２"], "argument --repeats"),
                           (["--repeats", "51"], "argument --repeats"),
                           (["--p2p-iters", "0"], "argument --p2p-iters")):
        rc, _, err = run(kvbench.lab.agree.main.main, "/nonexistent-plan.yaml", *argv)
        assert rc == 2 and err.count("\n") == 1 and fragment in err, err
    with pytest.raises(UsageError, match=r"--rates \(rps\) must be"):
        kvbench.lab.agree.main.parse_rates("1,１", None)
    assert kvbench.lab.agree.main.parse_rates("4, 1", None) == [1.0, 4.0]


def test_a_bad_master_port_is_one_answer_for_every_rank(monkeypatch):
    """MASTER_PORT went through int(): 'abc' was a traceback on rank 0 (and '１２' a port)."""
    from kvbench.p2p.transports import rendezvous

    class Comm:
        def Get_rank(self):
            return 0

        def bcast(self, value, root=0):
            return value

    for port, ok in (("29500", True), ("abc", False), ("１２", False), ("0", False), ("70000", False)):
        monkeypatch.setenv("MASTER_PORT", port)
        url, error = rendezvous.rendezvous_address(Comm(), ["h", "h"])
        assert (url is not None) == ok and (error is None) == ok, (port, url, error)
        if not ok:
            assert "MASTER_PORT must be" in error and "\n" not in error


# bounded values on the command line: infinity, NaN, denormals, huge numbers (issue 15, list B)


@pytest.mark.parametrize("cli, argv, fragment", [
    (kvbench.model.cli, ("--setup-ms", "inf"), "--setup-ms must be a non-negative number"),
    (kvbench.model.cli, ("--links-gbps", "1e-320"), "--links-gbps must be positive numbers (>= 1e-06"),
    (kvbench.model.cli, ("--prompt-tokens", "9" * 310), "--prompt-tokens must be positive integers"),
    (kvbench.model.cli, ("--prompt-tokens", ""), "--prompt-tokens: empty list"),
    (kvbench.model.cli, ("--budget-ms", "nan"), "--budget-ms must be positive numbers"),
    (kvbench.model.cli, ("--prompt-tokens", "999999999", "--model", "deepseek-v3"), None),
    (kvbench.plan.cli.cli, ("--gbps", "1e-320", "--setup-ms", "1", "--prompt-tokens", "300"), "--gbps must be positive"),
    (kvbench.plan.cli.cli, ("--gbps", "10", "--setup-ms", "inf", "--prompt-tokens", "300"), "--setup-ms must be"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--duration-s", "inf", "--out", "x"), "argument --duration-s"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1e9", "--out", "x"), "--rates must be positive numbers"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1000", "--duration-s", "100000", "--out", "x"),
     "synth writes at most 2,000,000"),
])
def test_numeric_flags_are_bounded(tmp_path, monkeypatch, cli, argv, fragment):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(cli, *argv)
    if fragment is None:  # bounded but valid: a correct, finite result
        assert rc == 0 and "Infinity" not in out and "NaN" not in out, err
        return
    refused((rc, out, err), fragment)
    assert not (tmp_path / "x").exists()


# one ASCII-digit rule and one empty-value rule for every list flag (issue 43, group 3)


def test_the_list_and_pair_rule_itself():
    """kvbench.errors.list_items and parse_int_pair, the rule behind every list flag: ASCII
    digits only, no empty item, bounds named."""
    assert errors.list_items(" a , b ", "--x") == ["a", "b"]
    assert errors.parse_int_pair(" 2:1 ", "--x", ":", 1, 8, "P:D") == (2, 1)
    for bad in ("2", "2:", ":1", "2:1:1", "0:1", "9:1", "2_0:1", "٢:1", "2 :1x"):
        with pytest.raises(errors.UsageError, match="--x expects P:D"):
            errors.parse_int_pair(bad, "--x", ":", 1, 8, "P:D")


# every bounded numeric flag, fuzzed (tests/fuzzing.py's property)

FLAG_VALUES = ["nan", "inf", "-inf", "1e-320", "1e400", "9" * 310, "", " ", "-1", "0", "0x10",
               "1_000", "１２", "1e306", "3.5", "-0", "+7", "1e9", "12abc"]


FLAGS = [
    (kvbench.model.cli, (), "--prompt-tokens"), (kvbench.model.cli, (), "--links-gbps"),
    (kvbench.model.cli, (), "--setup-ms"), (kvbench.model.cli, (), "--budget-ms"),
    (kvbench.model.cli, (), "--tp"), (kvbench.model.cli, (), "--block-size"),
    (kvbench.model.cli, (), "--short-prompt-tokens"),
    *[(kvbench.slo.cli.cli, ("analyze", "RECORDS", *ANALYZE), f) for f in
      ("--deadline-s", "--max-itl-ms", "--send-lag-max-ms", "--duration-s", "--warmup-requests",
       "--min-tokens-for-tpot")],
    (kvbench.slo.cli.cli, ("synth", "sweep", "--duration-s", "1"), "--rates"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1"), "--duration-s"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1", "--duration-s", "1"), "--warmup-requests"),
    (kvbench.slo.cli.cli, ("synth", "sweep", "--rates", "1", "--duration-s", "1"), "--seed"),
    # (issue 25) flags that were raw int(): the folder or plan does not exist, so an accepted
    # value ends in "no such ..." (exit 2) before any work; a hostile one must be refused first
    (kvbench.report.cli.cli, ("/nonexistent-kvbench-folder",), "--bootstrap"),
    (kvbench.lab.sweep.main.cli, ("/nonexistent-kvbench-plan.yaml",), "--repeats"),
    (kvbench.lab.faults.main.cli, ("/nonexistent-kvbench-plan.yaml",), "--requests"),
    (kvbench.fit.cli.cli, (str(ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.jsonl"),), "--bootstrap"),
]


@pytest.fixture(scope="module")
def records_file():
    d = workdir()
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cohort_lines()))
    return d / "r.jsonl"


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from(range(len(FLAGS))), st.sampled_from(FLAG_VALUES))
def test_fuzz_numeric_flags(records_file, which, value):
    cli, base, flag = FLAGS[which]
    d = workdir()
    out = d / ("o.jsonl" if "synth" in base else "o.json")
    argv = [str(records_file) if a == "RECORDS" else a for a in base]
    rc, stdout, err = run(cli, *argv, flag, value, "--out", out)
    must = value in ("nan", "inf", "-inf", "1e-320", "1e400", "9" * 310, "", " ", "１２", "12abc")
    check((rc, stdout, err), out, must)
    if must:  # refused by the flag parser itself, not later by a missing file
        assert f"argument {flag}" in err or flag in err, err
    if rc == 0:
        assert "NaN" not in stdout and "Infinity" not in stdout
