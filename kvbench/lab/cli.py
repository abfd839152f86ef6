"""`kvbench lab install|model|up|down|status|capture-metrics`: the local vLLM lab.

    kvbench lab install                      # the lab's own venv with vLLM's CPU build (~2 min)
    kvbench lab install --clients            # and AIPerf's and GuideLLM's own venvs (cached)
    kvbench lab up PLAN.yaml                 # both deployments, ready, then returns
    kvbench lab up PLAN.yaml --deployment disaggregated --foreground   # until Ctrl-C
    kvbench lab down                         # stop what `lab up` started (by PID group)
    kvbench lab agree PLAN.yaml --rates 1    # vLLM's NIXL metrics vs kvbench's predictions

Docs: docs/lab.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.env import require_env, state_dir
from kvbench.lab.stack.procs import LabState, run_interruptible, stop_all, stop_on_exit, write_state


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench lab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    i = sub.add_parser("install", help="create the lab venv (vLLM CPU build, NIXL) in the cache",
                       prog="kvbench lab install")
    i.add_argument("--clients", action="store_true",
                   help="also AIPerf and GuideLLM, each pinned in a venv of its own (cached)")
    m = sub.add_parser("model", help="build (once) and print the tiny model's folder", prog="kvbench lab model")
    m.add_argument("plan", nargs="?", metavar="PLAN.yaml")
    u = sub.add_parser("up", help="start local deployments from the plan's lab: section", prog="kvbench lab up")
    u.add_argument("plan", nargs="?", metavar="PLAN.yaml")
    u.add_argument("--deployment", choices=(*deploy.DEPLOYMENTS, "both"), default="both")
    u.add_argument("--foreground", action="store_true", help="stay, and stop everything on Ctrl-C")
    sub.add_parser("down", help="stop every deployment `lab up` started", prog="kvbench lab down")
    sub.add_parser("status", help="show what `lab up` started and whether it is alive",
                   prog="kvbench lab status")
    sub.add_parser("agree", help="vLLM's own NIXL metrics vs kvbench's engine-shaped and plain "
                   "predictions (kvbench lab agree PLAN.yaml --help)", prog="kvbench lab agree",
                   add_help=False)
    c = sub.add_parser("capture-metrics", help="capture real /metrics text of every role",
                       prog="kvbench lab capture-metrics")
    c.add_argument("--out-dir", required=True)
    c.add_argument("--requests", type=arg_int(1, 10_000), default=24)
    return p


def cmd_up(args) -> int:
    from kvbench.lab.planfile import load_lab_section

    require_env()
    cfg = load_lab_section(args.plan)
    names = deploy.DEPLOYMENTS if args.deployment == "both" else (args.deployment,)
    clash = [n for n in names if (state_dir() / f"{n}.json").exists()]
    if clash:
        raise UsageError(f"{clash[0]} is already up (state {state_dir() / (clash[0] + '.json')}); "
                         "run `kvbench lab down` first")
    model = deploy.model_for(cfg)
    started: list = []
    written: list[Path] = []
    try:
        with stop_on_exit(started):
            for name in names:
                st = deploy.bring_up(cfg, name, model, state_dir() / "logs", started)
                write_state(state_dir() / f"{name}.json", st)
                written.append(state_dir() / f"{name}.json")
                print(f"lab: {name} up: {st.endpoint} (metrics {st.metrics_endpoints})", flush=True)
            if args.foreground:
                print("lab: running; Ctrl-C stops everything", file=sys.stderr, flush=True)
                while True:
                    time.sleep(3600)
            started.clear()  # detached: `lab down` stops them from the state files
    except BaseException:
        for path in written:  # everything was stopped: no state may point at it
            path.unlink(missing_ok=True)
        raise
    return 0


def _states() -> list[tuple[Path, LabState]]:
    return [(p, LabState.from_json(p.read_text())) for p in sorted(state_dir().glob("*.json"))]


def cmd_down(args) -> int:
    states = _states()
    if not states:
        print("lab: nothing is up")
    for path, st in states:
        stop_all(st.services, out=sys.stdout)
        path.unlink()
    return 0


def cmd_status(args) -> int:
    for _, st in _states():
        for s in st.services:
            print(f"{st.deployment:<14} {s.name:<22} pid {s.pid:<8} port {s.port:<6} "
                  f"{'alive' if s.alive() else 'GONE'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "install":
        print(labenv.install())
        if args.clients:
            from kvbench.lab.load.clients import VERSIONS, install_client

            for tool in VERSIONS:
                print(install_client(tool))
        return 0
    if args.command == "model":
        from kvbench.lab.planfile import load_lab_section

        require_env()
        print(deploy.model_for(load_lab_section(args.plan)))
        return 0
    if args.command == "capture-metrics":
        from kvbench.lab.stack.capture import capture_metrics

        require_env()
        return capture_metrics(Path(args.out_dir), args.requests)
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status}
    if args.command not in handlers:
        parser.print_help()
        return 0
    return handlers[args.command](args)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_interruptible("kvbench lab", main, argv)
