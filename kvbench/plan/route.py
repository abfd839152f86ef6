"""Selective routing: keep a request's prefill local, or hand its KV to a remote prefill worker?

Plain functions with dataclass results, so the numbers can be checked directly; the
`kvbench plan route` CLI (kvbench.plan) only formats them.

The comparison, per prompt length, is the tutorial's:

    exposed_handoff_ms = handoff_floor_ms                    (sequential handoff)
                       = last layer's bytes / rate           (overlapped, layer by layer)
    delta_ms           = exposed_handoff_ms - local_interference_ms
    itl_headroom_ms    = itl_target_ms - itl_p95_ms          (the aggregated baseline)

delta_ms >= 0 means going remote adds at least that much; below zero it saves at most
-delta_ms (a floor is a lower bound on the handoff, so a saving computed from it is an
upper bound). Remote is only a candidate when it saves time *and* the baseline actually
misses its ITL target: without a violation there is no evidence that moving prefill
away buys anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvbench.units import transfer_ms

HANDOFF_MODES = ("sequential", "overlapped")
KEEP_LOCAL = "keep-local"
REMOTE_CANDIDATE = "remote-candidate"
NO_CLAIM = "evidence insufficient; no SLO violation claimed"
MAX_TOKENS = 10_000_000


@dataclass(frozen=True)
class LinkCost:
    """A link as the plan sees it for one payload: rate without setup, or an end-to-end rate."""

    effective_gb_s: float
    setup_ms: float | None  # None when includes_setup: the rate already contains it
    includes_setup: bool = False

    def handoff_floor(self, kv_bytes: int) -> tuple[float, float]:
        """(bandwidth_floor_ms, handoff_floor_ms), never adding setup to an end-to-end rate."""
        from kvbench.model import handoff_floor

        if self.includes_setup:
            bw = transfer_ms(kv_bytes, self.effective_gb_s)
            return bw, bw
        return handoff_floor(kv_bytes, self.effective_gb_s, self.setup_ms or 0.0)


@dataclass
class RouteDecision:
    prompt_tokens: int
    kv_bytes: int
    handoff: str
    effective_gb_s: float
    setup_ms: float | None
    includes_setup: bool
    bandwidth_floor_ms: float
    handoff_floor_ms: float
    exposed_handoff_ms: float
    local_interference_ms: float
    delta_ms: float
    added_ms: float | None  # at least this much added by going remote
    saved_ms: float | None  # at most this much saved by going remote
    itl_p95_ms: float
    itl_target_ms: float
    itl_headroom_ms: float
    slo_violated: bool
    verdict: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def exposed_ms(kv_bytes: int, layers: int, link: LinkCost, handoff: str) -> tuple[float, float, float]:
    """(bandwidth_floor_ms, handoff_floor_ms, exposed_ms) for one payload."""
    bw, floor = link.handoff_floor(kv_bytes)
    if handoff == "sequential":
        return bw, floor, floor
    if handoff == "overlapped":
        # Layer-by-layer sends overlap prefill compute except the last layer, which cannot
        # leave before it exists; setup is assumed hidden. The most optimistic exposure.
        return bw, floor, transfer_ms(kv_bytes / max(layers, 1), link.effective_gb_s)
    raise ValueError(f"handoff must be one of {HANDOFF_MODES}, got {handoff!r}")


def decide(prompt_tokens: int, kv_bytes: int, layers: int, link: LinkCost,
           local_interference_ms: float, itl_p95_ms: float, itl_target_ms: float,
           handoff: str = "sequential") -> RouteDecision:
    bw, floor, exposed = exposed_ms(kv_bytes, layers, link, handoff)
    delta = exposed - local_interference_ms
    headroom = itl_target_ms - itl_p95_ms
    violated = headroom < 0
    what = ("remote handoff floor" if handoff == "sequential"
            else "exposed tail of the overlapped handoff")
    baseline = (f"the aggregated baseline's P95 ITL {itl_p95_ms:g} ms "
                + (f"meets its {itl_target_ms:g} ms target with {headroom:g} ms to spare"
                   if not violated else
                   f"misses its {itl_target_ms:g} ms target by {-headroom:g} ms"))
    if delta >= 0:
        cost = (f"{what} {exposed:.4f} ms replaces {local_interference_ms:g} ms of local "
                f"prefill interference: adds at least {delta:.4f} ms")
    else:
        cost = (f"{what} {exposed:.4f} ms is below {local_interference_ms:g} ms of local "
                f"prefill interference: saves at most {-delta:.4f} ms")
    if not violated:
        verdict = KEEP_LOCAL
        reason = f"{cost}; {baseline}: {NO_CLAIM}"
    elif delta < 0:
        verdict = REMOTE_CANDIDATE
        reason = (f"{cost}; {baseline}: remote prefill is a candidate; confirm it with a "
                  "serving run (kvbench slo) before routing")
    else:
        verdict = KEEP_LOCAL
        reason = (f"{cost}; {baseline}, but routing this prompt remote makes it worse: "
                  "look elsewhere (chunked prefill, more decode capacity)")
    return RouteDecision(
        prompt_tokens=prompt_tokens, kv_bytes=kv_bytes, handoff=handoff,
        effective_gb_s=link.effective_gb_s, setup_ms=link.setup_ms,
        includes_setup=link.includes_setup, bandwidth_floor_ms=bw, handoff_floor_ms=floor,
        exposed_handoff_ms=exposed, local_interference_ms=local_interference_ms,
        delta_ms=delta, added_ms=delta if delta >= 0 else None,
        saved_ms=-delta if delta < 0 else None, itl_p95_ms=itl_p95_ms,
        itl_target_ms=itl_target_ms, itl_headroom_ms=headroom, slo_violated=violated,
        verdict=verdict, reason=reason)


@dataclass
class Breakeven:
    """Where the exposed handoff crosses the local interference, as prompts grow."""

    prompt_tokens: int | None
    remote_floor_below_interference_for: str  # longer prompts | shorter prompts | every | none
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def interference_at(local_interference_ms: float, at_tokens: int | None) -> Callable[[int], float]:
    """Constant interference, or (with at_tokens) scaled linearly from that prompt length.

    Prefill work grows at least linearly with prompt length (attention adds a quadratic
    term), so linear scaling understates long-prompt interference: it never flatters remote.
    """
    if at_tokens is None:
        return lambda t: local_interference_ms
    return lambda t: local_interference_ms * t / at_tokens


def breakeven(f: Callable[[int], float], max_tokens: int = MAX_TOKENS) -> Breakeven:
    """Scan f(t) = exposed(t) - interference(t) over prompt lengths 1..max_tokens.

    Returns the prompt length above which f stays below zero ("longer prompts"), or the
    longest prompt below which it is negative ("shorter prompts").
    """
    grid = sorted({1, max_tokens} | {int(round(v)) for v in
                                      (10 ** (k / 40) for k in range(0, 7 * 40 + 1))
                                      if 1 <= v <= max_tokens})
    vals = [f(t) for t in grid]
    neg = [v < 0 for v in vals]
    if all(neg):
        return Breakeven(None, "every prompt length",
                         "the exposed handoff is below the local interference at every length "
                         f"up to {max_tokens:,} tokens")
    if not any(neg):
        return Breakeven(None, "no prompt length",
                         f"the exposed handoff stays at or above the local interference up to "
                         f"{max_tokens:,} tokens")

    def bisect(lo: int, hi: int, want_neg_at_hi: bool) -> int:
        # f(lo) and f(hi) differ in sign; return the first t in (lo, hi] on hi's side.
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (f(mid) < 0) == want_neg_at_hi:
                hi = mid
            else:
                lo = mid
        return hi

    if neg[-1]:
        i = max(k for k in range(len(grid)) if not neg[k])
        t = bisect(grid[i], grid[i + 1], True)
        return Breakeven(t, "longer prompts",
                         f"from {t:,} tokens up the exposed handoff is below the local interference")
    i = max(k for k in range(len(grid)) if neg[k])
    t = bisect(grid[i], grid[i + 1], False) - 1
    return Breakeven(t, "shorter prompts",
                     f"only up to {t:,} tokens is the exposed handoff below the local "
                     "interference; longer prompts pay more on the link than they save "
                     "(pass --interference-at-tokens to scale interference with prompt length)")
