"""A real vLLM (CPU build) lab: local deployments, a rate sweep judged by kvbench.slo,
and fault injection into the KV handoff with a per-request audit. docs/lab.md.

Sub-packages, lowest first (tests/test_layout.py holds the order):
    venv/    runs inside the lab's own vLLM venv: imports no kvbench module
    config, planfile (here): the plan's `lab:` section
    load/    load generators, /metrics snapshots, the p2p reference fits
    stack/   the lab venv, processes, deployments, metrics capture, stack findings
    sweep/, faults/   `kvbench sweep`, `kvbench faults`
    agree/   `kvbench lab agree`
    cli (here): `kvbench lab install|model|up|down|status|capture-metrics`
This file stays import-light on purpose: lab.venv's modules run inside the lab venv (which
lacks kvbench's deps) and import this package on the way.
"""


def cli(argv=None):
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["agree"]:  # its own parser and modules (kvbench.lab.agree.main)
        from kvbench.lab.agree.main import cli as _agree

        return _agree(args[1:])
    from kvbench.lab.cli import cli as _cli

    return _cli(args)
