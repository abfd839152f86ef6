"""A store's two-hop handoff (prefill puts the KV into Mooncake Store, decode gets it from
there: kvbench p2p --pattern store) in a planner's words, for `kvbench plan export`.

Every planner kvbench exports to models one KV transfer per request, prefill to decode. The
two hops in series add term by term (setup to setup, ms/GB to ms/GB), so the handoff as decode
sees it, put + notice + get, is again setup + bytes / rate: kvbench fitted it as its own group
and exports that group as the one transfer. The put and the get alone (variants `put`, `get`)
are one hop each: exporting one would predict a handoff without the other, so it is refused.
What no planner here can hold: the store's capacity, its evictions and misses (a miss is a
recompute, not a slower transfer), and one store's bandwidth shared by every request.

`--pattern store-layerwise` moves the same store layer by layer, decode getting layer l while
prefill puts l+1: its put and get overlap, so they are not two hops in series and it has no
put/get variants. Its one fitted line is exported as the transfer, and the notes say that the
hops overlap and what of the store no planner holds (`layered` in `context.two_hop`).
"""

from __future__ import annotations

from kvbench.errors import UsageError

HOPS = ("put", "get")
STORE_PATTERNS = ("store", "store-layerwise")


def _cost(link) -> dict:
    return {"label": link.label, "setup_ms": link.setup_ms, "effective_gb_s": link.effective_gb_s}


def in_series(put: dict, get: dict) -> dict:
    """The two hops one after the other: setups add, and so do the ms per GB."""
    ms_per_gb = 1000.0 / put["effective_gb_s"] + 1000.0 / get["effective_gb_s"]
    return {"setup_ms": (put["setup_ms"] or 0.0) + (get["setup_ms"] or 0.0),
            "effective_gb_s": 1000.0 / ms_per_gb}


def store_handoff(links: list) -> tuple[list, dict | None]:
    """From the links a store fit holds (after --where): the whole handoff and, beside it,
    what is known of its two hops; links of no store pass through unchanged."""
    patterns = {(link.group or {}).get("pattern") for link in links}
    if not links or not patterns <= set(STORE_PATTERNS) or len(patterns) != 1:
        return links, None
    if patterns == {"store-layerwise"}:
        if len(links) != 1:
            return links, None
        return links, {"put": None, "get": None, "series": None, "layered": True,
                       "store_pool_bytes": links[0].store_pool_bytes}
    by = {}
    for link in links:
        by.setdefault(link.group.get("variant"), []).append(link)
    if len(links) == 1 and links[0].group.get("variant") in HOPS:
        hop = links[0].group["variant"]
        raise UsageError(f"this is the store's {hop} alone, one hop of a two-hop handoff, and a "
                         "planner's one transfer per request is the whole handoff (put + notice "
                         f"+ get): drop --where variant={hop} to export the handoff")
    whole = by.get(None, [])
    if len(whole) != 1 or any(len(by.get(h, [])) > 1 for h in HOPS) or set(by) - {None, *HOPS}:
        return links, None
    hops = {h: _cost(by[h][0]) if h in by else None for h in HOPS}
    series = in_series(hops["put"], hops["get"]) if all(hops.values()) else None
    return whole, {**hops, "series": series, "store_pool_bytes": whole[0].store_pool_bytes}


def two_hop_notes(two_hop: dict, tool: str, setup_as: str, capacity: int | None,
                  fold_tokens: int) -> list[str]:
    """What a tool's one transfer holds of the two hops, and what it cannot hold."""
    how = ("exact in BLIS's two terms: both hops' setups and the notice in the base latency, "
           "the hops in series in the bandwidth" if tool == "blis" else
           f"in one rate: the setup of both hops and the notice is "
           f"{'dropped' if setup_as == 'drop' else 'folded'} as any setup is")
    hops = ""
    if two_hop.get("series"):
        p, g, s = two_hop["put"], two_hop["get"], two_hop["series"]
        hops = (f" (fitted apart: put {p['setup_ms']:.4g} ms + {p['effective_gb_s']:.4g} GB/s, "
                f"get {g['setup_ms']:.4g} ms + {g['effective_gb_s']:.4g} GB/s, in series "
                f"{s['setup_ms']:.4g} ms + {s['effective_gb_s']:.4g} GB/s)")
    held = ("the store's capacity" if capacity is None else
            f"the store's capacity ({capacity:,} requests of {fold_tokens} tokens in "
            f"{two_hop['store_pool_bytes'] / 2**30:.4g} GiB)")
    if two_hop.get("layered"):
        first = ("the two hops of a store's handoff apart, here overlapped layer by layer "
                 "(decode gets layer l while prefill puts l+1: not two hops in series): the one "
                 "transfer is the handoff as decode sees it, fitted as one line, "
                 + ("exact in BLIS's two terms (its setup in the base latency, its rate in the "
                    "bandwidth)" if tool == "blis" else
                    f"in one rate: its setup is {'dropped' if setup_as == 'drop' else 'folded'} "
                    "as any setup is"))
    else:
        first = (f"the two hops of a store's handoff apart (prefill puts into the store, decode "
                 f"gets from it): the one transfer is the handoff as decode sees it (put + notice "
                 f"+ get, fitted as one line), {how}{hops}")
    return [first,
            f"{held}, its evictions and misses (a miss is a recompute, not a slower "
            "transfer), and one store's bandwidth shared by every request in flight"]
