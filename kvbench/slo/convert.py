"""`kvbench slo convert --from vllm|aiperf|guidellm`: another load generator's per-request
export, written as kvbench request records (kvbench.records.requests, schema-checked).

Each converter returns (records as JSON objects, notes); every record has been checked by
the schema `analyze` reads it with, so convert never writes a file analyze refuses. The
file appears whole or not at all (atomic write; never overwrites).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable

from kvbench.errors import UsageError
from kvbench.records.write import check_new_file, dumps_json, new_file_stream
from kvbench.slo.aiperf import convert_aiperf
from kvbench.slo.guidellm import convert_guidellm
from kvbench.slo.vllm import iter_converted

Converter = Callable[..., tuple[Iterable[dict], list[str]]]
CONVERTERS: dict[str, Converter] = {"vllm": iter_converted, "aiperf": convert_aiperf, "guidellm": convert_guidellm}
INPUTS = {"vllm": "vllm bench serve --save-result --save-detailed JSON",
          "aiperf": "aiperf profile artifact folder or its profile_export.jsonl",
          "guidellm": "guidellm run --output kind=json benchmarks.json"}


def convert(tool: str, path: str, deployment: str, offered_rate: float | None = None,
            index: int | None = None, cache_state: str | None = None) -> tuple[Iterable[dict], list[str]]:
    """Records of one run of TOOL, labelled with deployment (and cache state). vLLM's are
    streamed (one record in memory at a time: docs/robustness.md's bound for convert)."""
    if not deployment.strip():
        raise UsageError("--deployment must not be empty")
    if cache_state is not None and not cache_state.strip():
        raise UsageError("--cache-state must not be empty")
    rows, notes = CONVERTERS[tool](path, deployment, offered_rate, index)
    if cache_state is not None:
        rows = ({**r, "cache_state": cache_state} for r in rows)
    return rows, notes


def cmd_convert(args, tool: str) -> int:
    if args.out:
        check_new_file(args.out)
    rows, notes = convert(tool, args.result, args.deployment, args.offered_rate, args.index, args.cache_state)
    counts: dict[str, int] = {}
    rate = None
    with (new_file_stream(args.out) if args.out else contextlib.nullcontext(sys.stdout)) as fh:
        for r in rows:  # the file appears whole when done, or not at all
            counts[r["status"]] = counts.get(r["status"], 0) + 1
            rate = r["offered_rate_rps"]
            fh.write(dumps_json(r, indent=None) + "\n")
    if args.out:
        summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        print(f"{args.out}: {sum(counts.values())} records ({summary}) for {args.deployment} at "
              f"{rate:g} rps")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
