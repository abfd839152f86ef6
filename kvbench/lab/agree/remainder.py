"""Where a transfer's time goes beyond its post, on the engine and in kvbench's engine shape.

NIXL's xferDuration runs from the post's start to the look that first saw the READ done.
vLLM 0.32 posts a step's READs after the step's forward pass and looks at them right after,
in the same step (vllm/v1/worker/kv_connector_model_runner_mixin.py:79-95: start_load_kv,
then get_transfer_results -> _pop_done_transfers -> check_xfer_state); a READ still in flight
at that look is seen at a later step's look. So for every transfer

    xfer = post + (look gap, ~0.05 ms) + (if still in flight at the look) the wait for the
           next look (one engine step: ~1-2 ms idle, a forward pass when decode is busy)

and the mean remainder xfer - post is the in-flight share times the late READs' mean wait.
A READ is in flight at the look essentially only when the post returned before the READ had
finished (NIXL's transfer() said PROC, not DONE), which happens on fast posts: a slow post
(one that lost the core to NIXL's progress thread) finishes the READ while it waits.

Both sides give the same per-transfer record (the engine from kvbench.lab.venv.nixltrace inside
vLLM's decode worker, kvbench from its per-handoff telemetry), so each term is compared.
"""

from __future__ import annotations

import statistics

FAST_POST_MS = 0.5  # a post that did not lose the core (the slow mode is one 4 ms tick)
BUSY_LOOP_S = 1.0  # vLLM's worker yield-spins this long after its last step, then sleeps
# (vllm/distributed/device_communicators/shm_broadcast.py:138, :195-208)
DECODING_S = 0.01  # a post this soon after decode's work followed it (engine: another
# request was decoding, idle 0; kvbench: the post came right after --nixl-busy-ms)


def decompose(runs: list[dict | None]) -> dict | None:
    """Pooled over runs' transfers (dicts of lists: post_ms, xfer_ms, post_done, late):
    means, the in-flight share at the posting step's look and the late READs' wait (ms),
    the share of fast posts that returned before the READ was done, and per run the
    remainder xfer - post."""
    runs = [r for r in runs if r and r.get("post_ms")]
    if not runs:
        return None
    post = [x for r in runs for x in r["post_ms"]]
    xfer = [x for r in runs for x in r["xfer_ms"]]
    late = [x for r in runs for x in r["late"]]
    done = [x for r in runs for x in r["post_done"]]
    waits = [x - p for x, p, lt in zip(xfer, post, late, strict=True) if lt]
    fast = [d for p, d in zip(post, done, strict=True) if p <= FAST_POST_MS]
    n = len(post)
    return {
        "n": n, "runs": len(runs),
        "post_mean_ms": statistics.fmean(post), "xfer_mean_ms": statistics.fmean(xfer),
        "remainder_ms": statistics.fmean(xfer) - statistics.fmean(post),
        "in_flight_share": sum(late) / n, "in_flight_n": sum(late),
        "late_wait_mean_ms": statistics.fmean(waits) if waits else None,
        "in_flight_term_ms": sum(waits) / n,
        "fast_post_share": len(fast) / n,
        "fast_posts_not_done_share": (sum(1 - d for d in fast) / len(fast)) if fast else None,
        "remainder_per_run_ms": [statistics.fmean(r["xfer_ms"]) - statistics.fmean(r["post_ms"])
                                 for r in runs],
        "in_flight_share_per_run": [sum(r["late"]) / len(r["late"]) for r in runs],
    }


def remainder(doc: dict, rate: str, config: str) -> dict:
    """The engine's runs at `rate` against kvbench's `config` jobs, term by term, with what is
    left when kvbench's post is given the engine's in-flight term."""
    eng = decompose([r.get("transfers") for r in doc["engine"].get(rate, [])])
    kvb = decompose([(rep["configs"].get(config) or {}).get("transfers")
                     for rep in doc["p2p"]["repeats"]])
    kvb_runs = [(rep["configs"].get(config) or {}).get("transfers") for rep in doc["p2p"]["repeats"]]
    out = {"config": config, "engine": eng, "kvbench": kvb, "cold": _cold(doc),
           "engine_posts_by_worker_state": posts_by_worker_state(
               [r.get("transfers") for r in doc["engine"].get(rate, [])]),
           "kvbench_posts_by_worker_state": posts_by_worker_state(kvb_runs)}
    if eng and kvb:
        out["remainder_gap_ms"] = eng["remainder_ms"] - kvb["remainder_ms"]
        # kvbench's post with the engine's remainder, and the engine's post with kvbench's:
        # which of the two terms the xfer ratio's distance from 1 comes from
        out["xfer_ratio_with_engine_in_flight_term"] = eng["xfer_mean_ms"] / (
            kvb["post_mean_ms"] + eng["remainder_ms"])
        out["xfer_ratio_with_engine_post"] = eng["xfer_mean_ms"] / (
            eng["post_mean_ms"] + kvb["remainder_ms"])
    return out


def posts_by_worker_state(runs: list[dict | None]) -> dict | None:
    """Posts split by what decode's worker was doing before them: within BUSY_LOOP_S of
    decode's last work (vLLM's worker yield-spins on its step queue, and a post then tends to
    lose the core to NIXL's progress thread), of those the ones right after decode's work
    (`decoding`, idle < DECODING_S), or after longer idle (it slept). The engine's idle time
    comes from the P/D proxy's events, kvbench's from its telemetry (idle_ms, --nixl-waits
    engine runs)."""
    pairs = [(p, i) for r in runs if r and r.get("decode_idle_s")
             for p, i in zip(r["post_ms"], r["decode_idle_s"], strict=True) if i is not None]
    if not pairs:
        return None
    out = {}
    for name, keep in (("within_busy_loop", lambda i: i < BUSY_LOOP_S),
                       ("decoding", lambda i: i < DECODING_S),
                       ("after_idle", lambda i: i >= BUSY_LOOP_S)):
        posts = [p for p, i in pairs if keep(i)]
        out[name] = ({"n": len(posts), "post_mean_ms": statistics.fmean(posts),
                      "fast_share": sum(p <= FAST_POST_MS for p in posts) / len(posts)}
                     if posts else {"n": 0, "post_mean_ms": None, "fast_share": None})
    return out


def _cold(doc: dict) -> dict | None:
    """The deployment's first transfers (the warm-up before any measured run), kept apart."""
    w = (doc.get("engine_warmup") or {}).get("transfers")
    if not w or not w.get("xfer_ms"):
        return None
    return {"first_xfer_ms": w["xfer_ms"][0], "first_post_ms": w["post_ms"][0],
            "then_xfer_ms": w["xfer_ms"][1:]}
