#!/usr/bin/env python3
"""Compare a pytest-benchmark run of kvbench's hot paths with the committed baseline.

    .venv/bin/python benchmarks/compare.py benchmarks/baseline/baseline-1.json \\
        benchmarks/baseline/baseline-2.json NEW.json

The last file is the run to judge; the ones before it are baseline runs of the same suite.
Per benchmark it prints the medians, the ratio new / baseline and, where the benchmark names
a floor timed in the same run (the same bytes copied, compared or parsed), the same ratio of
kvbench / floor, which changes less with the machine and its load.

Regression rule: the noise of a benchmark is the relative difference between the medians of
two baseline runs (with one baseline: its interquartile range over its median). A new median
above the slower baseline by more than that noise is reported as a REGRESSION; below the faster
one by more than it, as faster; a REGRESSION whose kvbench / floor ratio stayed within the
noise is printed as 'ok (floor too)' (the machine was slower, not kvbench). Timing alone never fails: the exit status is 0 (2 for bad
input), so CI prints the comparison without failing on a busy machine.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _load(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"compare: cannot read {path}: {exc}")
    if not isinstance(doc, dict) or "benchmarks" not in doc:
        sys.exit(f"compare: {path} is not a pytest-benchmark JSON file (--benchmark-json)")
    return doc


def _medians(doc: dict) -> dict[str, dict]:
    return {b["name"]: {"median": b["stats"]["median"], "iqr": b["stats"]["iqr"],
                        "floor": (b.get("extra_info") or {}).get("floor")}
            for b in doc["benchmarks"]}


def _machine(doc: dict) -> str:
    m = doc.get("machine_info", {})
    k = m.get("kvbench", {})
    load = k.get("load_average_at_start")
    return (f"{m.get('cpu', {}).get('brand_raw', '?')}, {k.get('cpu_count', '?')} CPUs, Python "
            f"{m.get('python_version', '?')}, {k.get('git_describe', '?')}, load average at "
            f"start {load[0] if load else '?'}{' (short mode)' if k.get('short_mode') else ''}")


def noise(base: list[dict]) -> float:
    """Relative noise of one benchmark's median from its baseline runs."""
    meds = [b["median"] for b in base]
    if len(meds) >= 2:
        return (max(meds) - min(meds)) / min(meds)
    return base[0]["iqr"] / base[0]["median"]


def verdict(new: float, base: list[dict]) -> str:
    tol = noise(base)
    meds = [b["median"] for b in base]
    if new > max(meds) * (1 + tol):
        return "REGRESSION"
    if new < min(meds) / (1 + tol):
        return "faster"
    return "ok"


def normalized(name: str, new: dict, base: list[dict]) -> float | None:
    """(kvbench / floor now) / (kvbench / floor in the baselines): None without a floor."""
    floor = new[name]["floor"]
    if not floor or floor not in new or any(floor not in b for b in base):
        return None
    now = new[name]["median"] / new[floor]["median"]
    then = math.exp(sum(math.log(b[name]["median"] / b[floor]["median"]) for b in base)
                    / len(base))
    return now / then


def judged(name: str, new: dict, base: list[dict]) -> tuple[str, float | None]:
    """The verdict on the time; a slowdown that its floor shows too (the same bytes copied,
    compared or parsed, in the same run) is the machine, not kvbench: 'ok (floor too)'."""
    runs = [b[name] for b in base]
    v, norm = verdict(new[name]["median"], runs), normalized(name, new, base)
    if v == "REGRESSION" and norm is not None and norm <= 1 + noise(runs):
        v = "ok (floor too)"
    if name.startswith("test_floor_") and v != "ok":  # a floor measures the machine itself
        v = f"ok (machine {'slower' if v == 'REGRESSION' else 'faster'})"
    return v, norm


def compare(baselines: list[dict], new_doc: dict) -> list[str]:
    base = [_medians(d) for d in baselines]
    new = _medians(new_doc)
    lines = [f"baseline {i + 1}: {_machine(d)}" for i, d in enumerate(baselines)]
    lines.append(f"this run:   {_machine(new_doc)}")
    lines.append(f"{'benchmark':<44} {'baseline ms':>12} {'this run ms':>12} {'ratio':>7} "
                 f"{'noise':>6} {'vs floor':>8}  verdict")
    counts = {"ok": 0, "faster": 0, "REGRESSION": 0}
    for name in sorted(new):
        runs = [b[name] for b in base if name in b]
        if not runs:
            lines.append(f"{name:<44} {'-':>12} {1e3 * new[name]['median']:>12.2f}  (not in baseline)")
            continue
        ref = math.exp(sum(math.log(r["median"]) for r in runs) / len(runs))
        v, norm = judged(name, new, [b for b in base if name in b])
        counts["ok" if v.startswith("ok") else v] += 1
        lines.append(f"{name:<44} {1e3 * ref:>12.2f} {1e3 * new[name]['median']:>12.2f} "
                     f"{new[name]['median'] / ref:>7.3f} {100 * noise(runs):>5.1f}% "
                     f"{'-' if norm is None else f'{norm:.3f}':>8}  {v}")
    lines.append(f"{counts['REGRESSION']} regression(s), {counts['faster']} faster, {counts['ok']} "
                 "within the baseline noise (ratio = this run / geometric mean of the baselines' "
                 "medians; noise = spread between the baseline runs; vs floor = the same ratio of "
                 "kvbench / its floor, timed in the same run: 'ok (floor too)' when the floor "
                 "slowed as much; timing never fails CI)")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    *baselines, new = argv
    print("\n".join(compare([_load(p) for p in baselines], _load(new))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
