"""One spelling per idea across commands, and one declaration per flag (issue 41 item 4).

`kvbench model`, `plan` and `plan route` take prompt lengths as `--prompt-tokens` or `--sizes`
(kvbench p2p's spelling) and a link rate as `--gbps` or `--links-gbps`: either spelling gives
the same document, and the same refusal. `plan export` builds its fit, model and cut flags with
the functions `plan` uses (kvbench.plan.cli): the same flags, help, defaults and errors.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from kvbench import model as model_cmd
from kvbench.plan import cli as plan_cmd
from tests.conftest import ROOT

FIT = str(ROOT / "tests/data/runs/mpi-20261202/kvbench-p2p-20261202T175443Z.fit.json")
# every flag plan and plan export both take
SHARED = ("--fit", "--where", "--pair", "--model", "--model-config", "--dtype", "--block-size",
          "--kv-pages", "--block-ids")


def _run(cli, *argv: str) -> tuple[int, str, str]:
    """A command in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = cli(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def _ok(cli, *argv: str):
    rc, out, err = _run(cli, *argv)
    assert rc == 0, err
    return json.loads(out)


def _refused(cli, *argv: str) -> str:
    """The one error line, without the program's name (plan and export name themselves)."""
    rc, out, err = _run(cli, *argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.split(": error: ", 1)[1]


# ---------------------------------------------------------------------------
# one spelling per idea


@pytest.mark.parametrize("cli, base", [
    (model_cmd.cli, ["--format", "json", "--links-gbps", "10"]),
    (plan_cmd.cli, ["--format", "json", "--gbps", "10", "--setup-ms", "1"]),
    (plan_cmd.cli, ["--format", "json", "--fit", FIT, "--model", "llama-3.1-8b"]),
    (plan_cmd.cli, ["route", "--format", "json", "--gbps", "10", "--setup-ms", "1",
                    "--local-interference-ms", "2", "--itl-p95-ms", "35", "--itl-target-ms", "50"]),
])
def test_sizes_is_prompt_tokens(cli, base):
    argv = base
    by_tokens = _ok(cli, *argv, "--prompt-tokens", "300,2000")
    by_sizes = _ok(cli, *argv, "--sizes", "300,2000")
    assert by_sizes == by_tokens
    assert json.dumps(by_tokens).count("300") >= 1  # the lengths reached the document
    assert by_tokens != _ok(cli, *argv, "--sizes", "300")  # and the flag is not ignored


@pytest.mark.parametrize("cli, rest", [
    (model_cmd.cli, ["--format", "json", "--prompt-tokens", "2000"]),
    (plan_cmd.cli, ["--format", "json", "--setup-ms", "1", "--prompt-tokens", "2000"]),
])
def test_gbps_is_links_gbps(cli, rest):
    assert _ok(cli, *rest, "--gbps", "25,10") == _ok(cli, *rest, "--links-gbps", "25,10")
    assert _ok(cli, *rest, "--gbps", "25,10") != _ok(cli, *rest, "--gbps", "10")


@pytest.mark.parametrize("cli, rest, old, new, value", [
    (model_cmd.cli, [], "--prompt-tokens", "--sizes", "0"),
    (model_cmd.cli, [], "--links-gbps", "--gbps", "-1"),
    (plan_cmd.cli, ["--gbps", "10", "--setup-ms", "1"], "--prompt-tokens", "--sizes", "12x"),
    (plan_cmd.cli, ["--setup-ms", "1"], "--gbps", "--links-gbps", "fast"),
])
def test_either_spelling_is_refused_alike(cli, rest, old, new, value):
    assert _refused(cli, *rest, old, value) == _refused(cli, *rest, new, value)


def test_route_takes_sizes_for_its_required_prompt_lengths():
    base = ["route", "--gbps", "10", "--setup-ms", "1", "--local-interference-ms", "2",
            "--itl-p95-ms", "35", "--itl-target-ms", "50", "--format", "json"]
    assert _ok(plan_cmd.cli, *base, "--sizes", "300")["decisions"][0]["prompt_tokens"] == 300
    assert "--prompt-tokens/--sizes" in _refused(plan_cmd.cli, *base)


def test_the_model_help_names_both_spellings():
    text = " ".join(model_cmd.build_parser().format_help().split())
    assert "--prompt-tokens N[,N...], --sizes N[,N...]" in text
    assert "--gbps R[,R...], --links-gbps R[,R...]" in text


# ---------------------------------------------------------------------------
# plan and plan export: one declaration per flag


def _actions(parser) -> dict[str, object]:
    return {s: a for a in parser._actions for s in a.option_strings}


def _described(action) -> dict:
    """What a user meets of a flag: its spellings, value, default, choices and help."""
    return {"flags": tuple(action.option_strings), "dest": action.dest, "metavar": action.metavar,
            "default": action.default, "choices": action.choices, "help": action.help,
            "nargs": action.nargs, "kind": type(action).__name__,
            "type": getattr(action.type, "__qualname__", action.type)}


def test_plan_and_export_declare_their_shared_flags_alike():
    plan, export = _actions(plan_cmd.build_parser()), _actions(plan_cmd.build_export_parser())
    route = _actions(plan_cmd.build_route_parser())
    for flag in SHARED:
        assert _described(plan[flag]) == _described(export[flag]) == _described(route[flag]), flag
    assert export["--fit"].required and not plan["--fit"].required  # export needs a fit


def test_the_shared_flags_sit_in_groups_of_one_name():
    def group_of(parser, flag):
        return next(g.title for g in parser._action_groups
                    if any(flag in a.option_strings for a in g._group_actions))

    plan, export = plan_cmd.build_parser(), plan_cmd.build_export_parser()
    for flag in ("--model", "--model-config", "--dtype", "--block-size", "--kv-pages", "--block-ids"):
        assert group_of(plan, flag) == group_of(export, flag), flag


@pytest.mark.parametrize("flag, value", [
    ("--block-size", "0"), ("--block-size", "many"), ("--kv-pages", "both"),
    ("--dtype", "bf17"), ("--model", "no-such-model"), ("--where", "no-equals-sign"),
])
def test_plan_and_export_refuse_a_shared_flag_alike(flag, value):
    plan = _refused(plan_cmd.cli, "--fit", FIT, flag, value)
    export = _refused(plan_cmd.cli, "export", "--fit", FIT, "--to", "json", flag, value)
    assert plan == export


def test_plan_and_export_refuse_a_bad_cut_alike():
    cut = ["--block-size", "16", "--block-ids", "sideways"]
    plan = _refused(plan_cmd.cli, "--fit", FIT, *cut)
    export = _refused(plan_cmd.cli, "export", "--fit", FIT, "--to", "json", *cut)
    assert plan == export and "--block-ids" in plan


def test_export_still_writes_with_the_shared_flags():
    rc, out, err = _run(plan_cmd.cli, "export", "--fit", FIT, "--to", "json",
                        "--model", "llama-3.1-8b", "--dtype", "bf16")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["schema"].startswith("kvbench.kv-transfer-model/") and Path(FIT).name in json.dumps(doc)
