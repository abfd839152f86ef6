"""Simulated p2p records under correlated load, to measure how often the fit's intervals cover
the truth (tests/fit/test_fit_coverage.py, benchmarks/fit_coverage.py).

A link with a known setup and rate, time_ms = setup + bytes / rate, measured the way p2p does:
in interleaved rounds (each round times every size once, in a rotating order) or in
back-to-back blocks (all samples of one size, then the next). Each sample is slowed or sped up
by multiplicative load terms, which are what makes samples of one moment alike:

    per round     a shift shared by every sample taken in that round (in blocks order: in
                  that stretch of time), and now and then a stalled round (x1.2 .. x2)
    per size      a shift shared by every sample of one size in one run (buffer placement,
                  a cache that fits one size and not the next)
    drift         a slow ramp over the run, random in size and sign, centred so that its mean
                  over the run is zero (a drift that does not average out changes the link
                  itself, and no interval from one run could know)
    noise, stalls independent per sample; a stalled sample is x1.5 .. x5

The truth is the link without load: every term has median zero on the log scale.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbench.fit.data import spec_id
from kvbench.kv.geometry import DTYPES, ModelSpec
from kvbench.records.schema.p2p import SCHEMA_P2P
from kvbench.units import handoff_ms

SPEC = {"transport": "sim", "transport_options": {}, "pattern": "sequential", "variant": None,
        "granularity": "whole", "layout": "raw", "block_size": None, "dtype": None,
        "device": "cpu", "pack_kernel": None, "model": None, "compute": None,
        "layer_poll": None, "world": {"size": 2, "prefill_ranks": [0], "decode_ranks": [1]},
        "hosts": ["sim", "sim"]}
SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26)


@dataclass(frozen=True)
class Load:
    """Sizes of the load terms (standard deviations on the log scale; probabilities)."""

    round_shift: float = 0.03
    size_shift: float = 0.02
    drift: float = 0.03  # standard deviation of the ramp's total change over a run
    noise: float = 0.02
    stall: float = 0.05
    round_stall: float = 0.05


def _record(nbytes: int, samples: list[float], rounds: list[int], run_id: str, order: str,
            spec: dict = SPEC, **extra) -> dict:
    return {"schema": SCHEMA_P2P, "spec": spec, "spec_id": spec_id(spec), "run_id": run_id,
            "order": order, "bytes": int(nbytes), "samples_ms": samples, "sample_rounds": rounds,
            "n_samples": len(samples), "fit_as_link": True, "not_link_reason": None,
            "wrong": 0, "_source": "simulated", **extra}


def _stalls(rng: np.random.Generator, n: int, p: float, lo: float, hi: float) -> np.ndarray:
    hit = rng.random(n) < p
    return np.where(hit, np.log(rng.uniform(lo, hi, n)), 0.0)


def loaded_ms(rng: np.random.Generator, true_ms: np.ndarray, rounds: int, order: str,
              load: Load) -> np.ndarray:
    """(K, rounds) samples of K points with the given true times under the load terms."""
    K = len(true_ms)
    size_shift = rng.normal(0, load.size_shift, K)
    n = rounds * K
    # the time slot of (size k, round r): rotating order within each round, or size blocks
    if order == "rounds":
        slot = np.array([[r * K + (k - r) % K for r in range(rounds)] for k in range(K)])
        period = slot // K  # a round
    else:
        slot = np.array([[k * rounds + r for r in range(rounds)] for k in range(K)])
        period = slot  # every sample of a block is its own stretch of time
    ramp = rng.normal(0, load.drift) * (np.arange(n) / max(n - 1, 1) - 0.5)
    shift = rng.normal(0, load.round_shift, n) + _stalls(rng, n, load.round_stall, 1.2, 2.0)
    log_t = (size_shift[:, None] + ramp[slot] + shift[period]
             + rng.normal(0, load.noise, (K, rounds)) + _stalls(rng, K * rounds, load.stall,
                                                                1.5, 5.0).reshape(K, rounds))
    return true_ms[:, None] * np.exp(log_t)


def simulate_run(rng: np.random.Generator, *, setup_ms: float, effective_gb_s: float, rounds: int,
                 order: str = "rounds", load: Load = Load(), sizes=SIZES,
                 run_id: str = "sim-0") -> list[dict]:
    """One p2p run: a record per size, samples_ms and sample_rounds as p2p writes them."""
    true_ms = handoff_ms(setup_ms, np.asarray(sizes, dtype=float), effective_gb_s)
    ms = loaded_ms(rng, true_ms, rounds, order, load)
    return [_record(b, [float(v) for v in ms[k]], list(range(rounds)), run_id, order)
            for k, b in enumerate(sizes)]


# A descriptor sweep: llama-3.1-8b's 32 layers at 131,072 B/token (BF16; sized by
# kvbench.kv.geometry, as kvbench.model's preset), 64 and 256 tokens, block sizes 1..16
# tokens, one joint page per layer and block: (bytes, block size, descriptors)
_LLAMA_8B = ModelSpec("llama-3.1-8b", 32, 8, 128)
_BYTES_PER_TOKEN = _LLAMA_8B.bytes_per_token(DTYPES["bf16"])
CUT_POINTS = tuple((t * _BYTES_PER_TOKEN, bs, _LLAMA_8B.layers * t // bs)
                   for t in (64, 256) for bs in (1, 2, 4, 8, 16))


def cut_spec(block_size: int) -> dict:
    """The spec of one cut of the simulated link: only the block size differs."""
    return {**SPEC, "layout": "paged", "granularity": "block", "block_size": block_size}


# The same as a transport that joins adjacent descriptors sees it (NIXL): every block size
# with scattered ids (nothing joins) and contiguous ones (one run per layer is left), each a cut
JOINED_POINTS = tuple((b, (bs, ids), d, d if ids == "scattered" else _LLAMA_8B.layers)
                      for b, bs, d in CUT_POINTS for ids in ("scattered", "contiguous"))


def simulate_cut_run(rng: np.random.Generator, *, setup_ms: float, effective_gb_s: float,
                     us_per_desc: float, rounds: int, points=CUT_POINTS, order: str = "rounds",
                     load: Load = Load(), run_id: str = "sim-0",
                     us_per_merged_desc: float = 0.0) -> list[dict]:
    """One p2p run of a descriptor sweep: every (bytes, cut, descriptors[, descriptors left
    after joining]) point timed in the same interleaved rounds, time = setup + bytes / rate +
    descriptors x us / 1000 (+ joined x us_merged / 1000), under the same load terms; a record
    per point with its cut's spec (a block size, or (block size, block ids)) and the counts."""
    b = np.array([p[0] for p in points], dtype=float)
    d = np.array([p[2] for p in points], dtype=float)
    m = np.array([p[3] if len(p) > 3 else p[2] for p in points], dtype=float)
    true_ms = handoff_ms(setup_ms, b, effective_gb_s, d, us_per_desc) + m * us_per_merged_desc / 1e3
    ms = loaded_ms(rng, true_ms, rounds, order, load)
    out = []
    for k, p in enumerate(points):
        spec = cut_spec(p[1]) if isinstance(p[1], int) else {
            **cut_spec(p[1][0]), "cut": {"kv": "joint", "blocks": p[1][1], "tp": "1:1"}}
        extra = {"descriptors_merged": int(p[3])} if len(p) > 3 else {}
        out.append(_record(p[0], [float(v) for v in ms[k]], list(range(rounds)), run_id, order,
                           spec, descriptors=int(p[2]), block_size=spec["block_size"], **extra))
    return out


def simulate(rng: np.random.Generator, *, runs: int = 1, **kw) -> list[dict]:
    out = []
    for i in range(runs):
        out += simulate_run(rng, run_id=f"sim-{i}", **kw)
    return out


Method = Callable[[list[dict]], tuple]  # records -> (setup_ci, rate_ci), None where no interval


def kvbench_method(n_boot: int = 1000) -> Method:
    """The fit as `kvbench fit` runs it: intervals of setup_ms and effective_gb_s."""
    from kvbench.fit.fitting import fit_records

    def method(records):
        (gf,), _ = fit_records(records, n_boot=n_boot, seed=0)
        return gf.record["setup_ms_ci95"], gf.record["effective_gb_s_ci95"]

    return method


def _covers(ci, truth: float) -> bool:
    lo, hi = ci
    return (lo is None or lo <= truth) and (hi is None or truth <= hi)


def coverage(method: Method, *, trials: int = 200, seed: int = 0, setup_ms: float = 0.5,
             effective_gb_s: float = 2.0, **kw) -> dict:
    """Share of simulated runs whose 95% intervals contain the true setup and rate."""
    hits = np.zeros(2)
    refused = 0
    for t in range(trials):
        rng = np.random.default_rng([seed, t])
        setup_ci, rate_ci = method(simulate(rng, setup_ms=setup_ms, effective_gb_s=effective_gb_s, **kw))
        if setup_ci is None or rate_ci is None:
            refused += 1
            continue
        hits += [_covers(setup_ci, setup_ms), _covers(rate_ci, effective_gb_s)]
    done = trials - refused
    return {"trials": trials, "with_interval": done,
            "setup": float(hits[0] / done) if done else None,
            "rate": float(hits[1] / done) if done else None}


def describe(kw: dict) -> str:
    load = kw.get("load", Load())
    return json.dumps({k: v for k, v in kw.items() if k != "load"} | {"load": load.__dict__})
