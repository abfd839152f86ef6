"""What the engine itself says about its KV transfers during one run of `kvbench lab agree`.

The decode instance's NIXL histograms (vLLM 0.32.0, NX/stats.py:162-285) are read right
before and right after the run; the difference of `_sum` and `_count` gives the exact mean
of every transfer in the run (no interpolation), and the difference of each `_bucket` the
fraction of transfers at or below that bound. Percentiles are never interpolated here: the
buckets are too coarse for that (vllm:nixl_xfer_time_seconds starts at 5 ms).

    post   vllm:nixl_post_time_seconds   NIXL telemetry postDuration
    xfer   vllm:nixl_xfer_time_seconds   NIXL telemetry xferDuration (post start to the
                                         engine-step poll that first saw DONE)
    bytes  vllm:nixl_bytes_transferred   totalBytes per transfer
    descs  vllm:nixl_num_descriptors     descCount after NIXL's merging
    itl    vllm:inter_token_latency_seconds  decode's step time while it generates: the
                                         poll cadence a transfer sees at that rate
"""

from __future__ import annotations

import math
import time
from itertools import pairwise

from kvbench.slo.engine_metrics import histogram
from kvbench.slo.engines import Metric
from kvbench.slo.scrape import Endpoint, scrape_once

FAMILIES = {
    "post": "vllm:nixl_post_time_seconds",
    "xfer": "vllm:nixl_xfer_time_seconds",
    "bytes": "vllm:nixl_bytes_transferred",
    "descs": "vllm:nixl_num_descriptors",
    "itl": "vllm:inter_token_latency_seconds",
}
SECONDS = {"post", "xfer", "itl"}


def _keep(sample_name: str) -> bool:
    return any(sample_name.startswith(f) for f in FAMILIES.values())


def read(url: str, timeout_s: float = 20.0, tries: int = 3) -> dict[str, tuple] | None:
    """{key: (cumulative buckets, sum, count)} of one /metrics reading, None if it did not
    answer in `tries` attempts (a busy host can miss one: the run would then go uncounted)."""
    for _ in range(tries):
        line = scrape_once(Endpoint("decode", url), time.monotonic(), timeout_s, _keep)
        if line["kind"] == "sample":
            break
        time.sleep(1.0)
    else:
        return None
    out = {}
    for key, name in FAMILIES.items():
        h = histogram(line["samples"], Metric(name, "histogram"))
        if h is not None:
            out[key] = h
    return out


def delta(before: dict | None, after: dict | None) -> dict[str, dict]:
    """Per family what happened between two readings: count, exact mean (ms for times), and
    [[upper bound, fraction of the run's observations in that bucket]] (ms for times)."""
    out: dict[str, dict] = {}
    if not before or not after:
        return out
    for key, (b_after, s_after, n_after) in after.items():
        b_before, s_before, n_before = before.get(key, ({}, 0.0, 0.0))
        n = n_after - n_before
        if n <= 0:
            out[key] = {"count": 0, "mean": None, "buckets": []}
            continue
        scale = 1e3 if key in SECONDS else 1.0
        buckets, below = [], 0.0
        for le in sorted(b_after):
            cum = b_after[le] - b_before.get(le, 0.0)
            buckets.append(["+Inf" if math.isinf(le) else le * scale, (cum - below) / n])
            below = cum
        out[key] = {"count": int(n), "mean": (s_after - s_before) / n * scale,
                    "unit": "ms" if key in SECONDS else ("bytes" if key == "bytes" else "count"),
                    "buckets": buckets}
    return out


def step_draws(itl: dict | None) -> dict | None:
    """The decode step-time distribution of a run as `kvbench p2p --nixl-poll draw:FILE` reads
    it (cumulative counts per upper bound in ms); None without a finite-bucket observation."""
    if not itl or not itl.get("count"):
        return None
    le, count, cum = [], [], 0.0
    for bound, frac in itl["buckets"]:
        if bound == "+Inf":
            break
        cum += frac * itl["count"]
        le.append(bound)
        count.append(round(cum))
    if not count or count[-1] <= 0:
        return None
    return {"le_ms": le, "count": count,
            "source": "decode vllm:inter_token_latency_seconds over the run"}


def read_trace(path, start: int = 0) -> list[dict]:
    """The engine's per-transfer trace lines (kvbench.lab.venv.nixltrace) from line `start` on;
    [] when there is no file. A torn last line (the engine still writing) is left out."""
    import json
    from pathlib import Path

    try:
        lines = Path(path).read_text().splitlines()[start:]
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            continue
    return out


def trace_transfers(recs: list[dict]) -> dict | None:
    """The traced transfers as agree's remainder reads them (kvbench.lab.agree.remainder), in
    the same form as kvbench's per-handoff telemetry: post and xfer (NIXL's, ms), whether the
    post itself returned DONE, whether the look in the posting step still saw it in flight
    (`late`), and whether a notification (a lease heartbeat) went out between post and look."""
    done = [r for r in recs if r.get("tel") and r.get("looks")]
    if not done:
        return None
    return {"post_ms": [r["tel"]["post_us"] / 1e3 for r in done],
            "xfer_ms": [r["tel"]["xfer_us"] / 1e3 for r in done],
            "post_done": [int(r.get("post_state") == "DONE") for r in done],
            "late": [int(r["looks"][0][1] == "PROC") for r in done],
            "notif_between": [int(bool(r.get("notifs"))) for r in done],
            "unix": [r["unix"] for r in done]}


def decode_idle(unix: list[float], events_path) -> list[float | None]:
    """Per post (wall time): how long decode had been without work, from the P/D proxy's
    events: 0 while another request was decoding, else the time since the last request
    finished on decode (None before the first). vLLM's worker yield-spins on its step queue
    for 1 s after its last step, then sleeps (vllm/distributed/device_communicators/
    shm_broadcast.py:195-208): this says which of the two a post came from."""
    import json
    from pathlib import Path

    try:
        events = [json.loads(ln) for ln in Path(events_path).read_text().splitlines() if ln]
    except (OSError, ValueError):
        return [None] * len(unix)
    sent, done = {}, {}
    for e in events:
        if e.get("step") in ("decode_sent", "decode_done"):
            (sent if e["step"] == "decode_sent" else done)[e["id"]] = e["t"]
    spans = [(sent[k], done[k]) for k in sent if k in done]
    out = []
    for t in unix:
        # another request decoding (its own decode starts just before its post: 50 ms apart)
        if any(a < t - 0.05 < t < b for a, b in spans):
            out.append(0.0)
            continue
        before = [b for _, b in spans if b < t]
        out.append(t - max(before) if before else None)
    return out


def look_intervals(recs: list[dict]) -> list[float]:
    """Decode's step cadence while a READ is in flight, from its trace: the time between two
    successive looks at one transfer (ms). An idle decode steps every ~2 ms (vLLM sleeps 1 ms
    between steps that run no model, vllm/v1/engine/core.py:1614-1617), a busy one after its
    next forward pass; this is the cadence a late READ actually waits on, which the
    inter-token-latency histogram (a first bucket of 0-10 ms) cannot resolve."""
    out = []
    for r in recs:
        looks = r.get("looks") or []
        out += [round((b[0] - a[0]) / 1e3, 4) for a, b in pairwise(looks) if b[0] >= a[0]]
    return out
