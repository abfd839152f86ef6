"""`kvbench <command> [...]`: one console script whose subcommands mirror the modules.

Every subcommand also runs as `python -m kvbench.<command>`.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "model": ("kvbench.model", "KV-cache size and handoff floors for a model and links"),
    "p2p": ("kvbench.p2p.__main__", "measure prefill->decode KV handoff between MPI ranks (run under mpirun)"),
    "fit": ("kvbench.fit.cli", "fit setup_ms and effective GB/s to measured samples"),
    "matrix": ("kvbench.matrix.cli", "every ordered pair of ranks measured and fitted; slow and odd-path pairs named (under MPI)"),
    "plan": ("kvbench.plan.cli", "handoff floors, budget verdicts and routing from fitted numbers"),
    "slo": ("kvbench.slo.cli", "serving SLO analysis: TTFT/TPOT/ITL, attainment, capacity"),
    "report": ("kvbench.report.cli", "summarise a results folder: tables, fits, environment, warnings"),
    "lab": ("kvbench.lab", "a real local vLLM (CPU): install, up, down"),
    "sweep": ("kvbench.lab.sweep.main", "rate sweep of a plan's deployments (vllm bench serve, AIPerf or GuideLLM), judged"),
    "faults": ("kvbench.lab.faults.main", "inject failed KV transfers into the P/D deployment and audit"),
}


def _usage() -> str:
    lines = ["usage: kvbench <command> [options]   (kvbench <command> --help for each)", "", "commands:"]
    lines += [f"  {name:<7} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        from kvbench.errors import one_line

        print(one_line(f"kvbench: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; "
                       "see kvbench --help)"), file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
