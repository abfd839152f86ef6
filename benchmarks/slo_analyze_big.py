#!/usr/bin/env python3
"""Bounded memory for big inputs: `kvbench slo analyze` on a 10^6-line request-records file.

Writes a records file of N requests (default 10^6; 16 streamed chunks each, two
deployments x four rates, deterministic), then runs `python -m kvbench.slo analyze` on it
in a child process and prints its wall time and peak RSS, beside two baselines measured in
the same run on the same file:

  - parse floor: `json.loads` of every line and nothing else (what any JSONL reader pays);
  - file size: memory is compared with the bytes of the file, which the old reader held as
    text and then as ~2 KB Python objects per request.

    .venv/bin/python benchmarks/slo_analyze_big.py              # 10^6 lines, ~430 MB file
    .venv/bin/python benchmarks/slo_analyze_big.py --requests 100000 --keep

Peak RSS is the child's own (VmHWM: benchmarks/peak_child.py; not ru_maxrss, which counts
the parent's memory at the fork). Numbers from a busy machine say so (--note).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bigfile import add_common_flags, parse_floor, report, run_child, workdir  # noqa: E402

CHUNKS = 16
RATES = (50.0, 100.0, 200.0, 400.0)


def _record(i: int, dep: str, rate: float) -> str:
    send = i * 1000.0 / rate
    first = send + 120.0 + (i % 17)
    chunks, t = [], first
    for k in range(CHUNKS):
        chunks.append(round(t, 3))
        t += 20.0 + (i + k) % 5
    status = "error" if i % 997 == 0 else "ok"
    rec = {"schema": "kvbench.slo.request/1", "request_id": f"{dep[:3]}-{rate:g}-{i}",
           "deployment": dep, "offered_rate_rps": rate, "scheduled_send_ms": round(send, 3),
           "actual_send_ms": round(send + 0.3, 3), "status": status}
    if status == "ok":
        rec.update(chunk_times_ms=chunks, chunk_tokens=[1] * CHUNKS, output_tokens=CHUNKS)
    else:
        rec.update(output_tokens=0, end_ms=round(send + 5.0, 3), error="HTTP 500 (synthetic)")
    return json.dumps(rec, separators=(",", ":")) + "\n"


def write_records(path: Path, n: int) -> None:
    runs = [(d, r) for d in ("aggregated", "disaggregated") for r in RATES]
    per = n // len(runs)
    with open(path, "w") as fh:
        for i in range(per):  # runs interleaved, as a merged file would be
            fh.writelines(_record(i, d, r) for d, r in runs)


def run_analyze(path: Path, out: Path) -> tuple[float, float]:
    wall, peak, _ = run_child(["kvbench.slo", "analyze", str(path), "--ttft-max-ms", "500",
                               "--tpot-max-ms", "30", "--denominator", "all_offered_after_warmup",
                               "--attainment-min", "0.9", "--format", "json", "--out", str(out)],
                              "analyze")
    return wall, peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    add_common_flags(p)
    args = p.parse_args()
    with workdir(args.dir, args.keep, "kvbench-big-", ("records.jsonl", "report.json")) as tmp:
        records, out = tmp / "records.jsonl", tmp / "report.json"
        write_records(records, args.requests)
        size_mb = records.stat().st_size / 2**20
        lines = sum(1 for _ in open(records, "rb"))
        floor_s = parse_floor(records)
        wall_s, peak_mib = run_analyze(records, out)
        groups = len(json.loads(out.read_text())["groups"])
    report(f"slo analyze: {lines:,} lines ({size_mb:.0f} MiB, {CHUNKS} chunks per request), "
           f"{groups} runs", wall_s, peak_mib, floor_s, size_mb, "analyze", args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
