"""`kvbench slo convert --from vllm|aiperf|guidellm`: another load generator's per-request
export, written as kvbench request records (kvbench.records.requests, schema-checked).

Each converter returns (records as JSON objects, notes); every record has been checked by
the schema `analyze` reads it with, so convert never writes a file analyze refuses. The
file appears whole or not at all (atomic write; never overwrites).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from kvbench.cli import UsageError
from kvbench.records.requests import dumps_jsonl
from kvbench.records.write import check_new_file, write_new_file
from kvbench.slo.aiperf import convert_aiperf
from kvbench.slo.guidellm import convert_guidellm
from kvbench.slo.vllm import convert_vllm

Converter = Callable[..., tuple[list[dict], list[str]]]
CONVERTERS: dict[str, Converter] = {"vllm": convert_vllm, "aiperf": convert_aiperf, "guidellm": convert_guidellm}
INPUTS = {"vllm": "vllm bench serve --save-result --save-detailed JSON",
          "aiperf": "aiperf profile artifact folder or its profile_export.jsonl",
          "guidellm": "guidellm run --output kind=json benchmarks.json"}


def convert(tool: str, path: str, deployment: str, offered_rate: float | None = None,
            index: int | None = None, cache_state: str | None = None) -> tuple[list[dict], list[str]]:
    """Records of one run of TOOL, labelled with deployment (and cache state)."""
    if not deployment.strip():
        raise UsageError("--deployment must not be empty")
    if cache_state is not None and not cache_state.strip():
        raise UsageError("--cache-state must not be empty")
    rows, notes = CONVERTERS[tool](path, deployment, offered_rate, index)
    if cache_state is not None:
        rows = [{**r, "cache_state": cache_state} for r in rows]
    return rows, notes


def summary(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def cmd_convert(args, tool: str) -> int:
    if args.out:
        check_new_file(args.out)
    rows, notes = convert(tool, args.result, args.deployment, args.offered_rate, args.index, args.cache_state)
    text = dumps_jsonl(rows)
    if args.out:
        write_new_file(Path(args.out), text)
        print(f"{args.out}: {len(rows)} records ({summary(rows)}) for {args.deployment} at "
              f"{rows[0]['offered_rate_rps']:g} rps")
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
