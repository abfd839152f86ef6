#!/usr/bin/env python3
"""Bounded memory for big inputs: `kvbench fit` on a 10^6-line p2p records file.

Writes a records file (default 10^6 lines) of p2p records as `kvbench p2p` writes them in
rounds order (spec, spec_id, run_id, order, sample_rounds, fit_as_link, n_samples; without
the per-rank `env`, `argv` and `transport_info`, which the fit does not read), then runs
`python -m kvbench.fit` on it in a child process and prints its wall time and peak RSS beside
a floor measured in the same run on the same file: `json.loads` of every line and nothing
else (what any JSON Lines reader pays).

Shape (deterministic): --specs specs (two transports x host pairs), each measured in runs of
--rounds rounds over --sizes payload sizes 256 KiB, 512 KiB, ...; one record per (run, size)
holding one sample per round. `--format legacy` writes records without the spec fields
(blocks order: each record is one back-to-back block), as files written before issue 12.

    .venv/bin/python benchmarks/fit_big.py                     # 10^6 lines
    .venv/bin/python benchmarks/fit_big.py --lines 100000 --keep --dir /tmp/big

Peak RSS is the child's own (VmHWM: benchmarks/peak_child.py; not ru_maxrss, which counts
the parent's memory at the fork). Numbers from a busy machine say so (--note).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bigfile import add_common_flags, parse_floor, report, run_child, workdir  # noqa: E402

TRANSPORTS = (("mpi", {"path": "host"}, 0.35, 2.0), ("gloo", {"host_staged": False}, 1.2, 0.9))


def _spec(transport: str, options: dict, hosts: list[str]) -> dict:
    return {"transport": transport, "pattern": "sequential", "granularity": "whole",
            "layout": "raw", "device": "cpu",
            "world": {"size": 2, "prefill_ranks": [0], "decode_ranks": [1]}, "hosts": hosts,
            "transport_options": options, "variant": None, "block_size": None, "dtype": None,
            "pack_kernel": None, "model": None, "compute": None, "layer_poll": None}


def _spec_id(spec: dict) -> str:
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _lines_of_run(run: int, spec: dict, sid: str, setup: float, gbps: float, sizes: list[int],
                  rounds: int, legacy: bool, rng: np.random.Generator) -> list[str]:
    shift = rng.normal(0, 0.03, rounds)  # each round's load, shared by every size in it
    out = []
    for b in sizes:
        t = (setup + b / (gbps * 1e9) * 1e3) * np.exp(shift + rng.normal(0, 0.02, rounds))
        samples = [round(float(v), 4) for v in t]
        rec = {"schema": "kvbench.p2p/1", "transport": spec["transport"], "layout": "raw",
               "dtype": None, "device": "cpu", "model": None, "world_size": 2,
               "hosts": spec["hosts"], "pattern": "sequential", "prompt_tokens": None,
               "granularity": "whole", "bytes": b, "wrong": 0, "iters": rounds,
               "samples_ms": samples}
        if not legacy:
            rec.update(run_id=f"run-{run:07d}", order="rounds", n_samples=rounds,
                       sample_rounds=list(range(rounds)), fit_as_link=True,
                       not_link_reason=None, spec=spec, spec_id=sid)
        out.append(json.dumps(rec, separators=(",", ":")) + "\n")
    return out


def write_records(path: Path, lines: int, n_specs: int, n_sizes: int, rounds: int,
                  legacy: bool) -> None:
    rng = np.random.default_rng(0)
    sizes = [256 * 1024 << k for k in range(n_sizes)]
    specs = []
    for i in range(n_specs):
        transport, options, setup, gbps = TRANSPORTS[i % len(TRANSPORTS)]
        spec = _spec(transport, options, [f"node{2 * i:03d}", f"node{2 * i + 1:03d}"])
        specs.append((spec, _spec_id(spec), setup, gbps))
    written, run = 0, 0
    with open(path, "w") as fh:
        while written < lines:
            spec, sid, setup, gbps = specs[run % n_specs]  # runs of the specs interleaved
            chunk = _lines_of_run(run, spec, sid, setup, gbps, sizes, rounds, legacy, rng)
            chunk = chunk[: lines - written]
            fh.writelines(chunk)
            written += len(chunk)
            run += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--specs", type=int, default=4)
    p.add_argument("--sizes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20, help="rounds per run = samples per record")
    p.add_argument("--format", choices=("spec", "legacy"), default="spec")
    p.add_argument("--bootstrap", type=int, default=1000)
    add_common_flags(p)
    args = p.parse_args()
    with workdir(args.dir, args.keep, "kvbench-fitbig-", ("records.jsonl", "records.fit.json")) as tmp:
        records, fit_json = tmp / "records.jsonl", tmp / "records.fit.json"
        write_records(records, args.lines, args.specs, args.sizes, args.rounds,
                      args.format == "legacy")
        size_mb = records.stat().st_size / 2**20
        floor_s = parse_floor(records)
        wall_s, peak_mib, _ = run_child(["kvbench.fit", str(records), "--out", str(fit_json),
                                         "--bootstrap", str(args.bootstrap)], "fit")
        doc = json.loads(fit_json.read_text())
    n_samples = sum(g["n_samples"] for g in doc["groups"])
    report(f"kvbench fit: {args.lines:,} lines ({size_mb:.0f} MiB, {args.format} format, "
           f"{args.rounds} samples per record), {len(doc['groups'])} groups, {n_samples:,} "
           f"samples, {args.bootstrap} resamples", wall_s, peak_mib, floor_s, size_mb, "fit",
           args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
