"""`kvbench plan export`: a fitted handoff model in the words of the tools planners use.

    kvbench plan export --fit run.fit.json --to dynamo|aisimulate|blis|splitwise|json \\
        [--model M] [--dtype D] [--tp N] [--fold-at-tokens 2000] [--setup-as fold|drop] [--out F]

One tool-neutral document, `kvbench.kv-transfer-model/1`, is built first (setup_ms and
effective GB/s with their 95% intervals, bytes per token per TP rank, transport, link and
where it came from); every tool's fragment is derived from it, never from the fit directly:

    handoff_ms(tokens) = setup_ms + tokens x bytes_per_token_per_rank / (GB/s x 1e9) x 1000

Each rank moves its own shard over its own link in parallel, so the per-rank bytes set the
time. A fit with a per-descriptor term (kvbench.fit.descriptors) needs the deployment's cut
(--block-size, --kv-pages, --block-ids): its count is a constant plus a part per token; the
per-token part goes into the bandwidth (exact at whole-block prompts) and the constant part
with setup (BLIS: its base latency, exact; other tools: folded or dropped as setup is). A
tool that has no setup term gets either the setup folded into an effective rate
that is exact at one stated prompt length (`--setup-as fold`, the default) or the bandwidth
term alone (`--setup-as drop`); the fragment says which and what it misses elsewhere.
Parameter names are checked against each tool's sources (docs/planners.md cites them).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.errors import UsageError
from kvbench.kv.geometry import KVSizing, aligned_tokens
from kvbench.plan.twohop import two_hop_notes
from kvbench.records.schema.plan import SCHEMA_KV_MODEL, KVTransferModel
from kvbench.records.write import as_contract, dumps_json
from kvbench.units import handoff_ms

TOOLS = ("json", "dynamo", "aisimulate", "blis", "splitwise")
CHECK_TOKENS = (500, 2000, 8000)
GIB = 2**30


def folded_gb_s(setup_ms: float, effective_gb_s: float, nbytes: int) -> float:
    """The rate that moves nbytes in exactly setup + nbytes/rate: setup folded in at that size."""
    return nbytes / (handoff_ms(setup_ms, nbytes, effective_gb_s) / 1000.0) / 1e9


def descriptor_model(link, model, dtype, tp: int, planned, fold_tokens: int) -> dict | None:
    """The per-descriptor term at the planned cut, split the way a tool can take it: the
    count is a constant plus a part per prompt token (blocks grow with the prompt; merged
    pages do not), exact at whole-block prompt lengths below any sliding window. The constant
    goes where a tool has a per-transfer latency, the per-token part into its bandwidth."""
    from kvbench.kv.cut import Cut, page_layout
    from kvbench.kv.shards import ShardError
    from kvbench.plan.descriptors import counts_at, descriptor_ms

    if link.us_per_desc is None:
        if planned is not None:
            raise UsageError("this fit has no per-descriptor term ("
                             + (link.no_descriptor_term or "no cuts of the link fitted together")
                             + "): drop --block-size/--kv-pages/--block-ids")
        return None
    if planned is None:
        raise UsageError("this fit has a per-descriptor term: give the deployment's cut to fold "
                         "it in (--block-size, and --kv-pages/--block-ids if not joint, contiguous)")
    c = planned.cut
    cut = Cut(c.block_size, c.kv, c.blocks, (tp, tp))
    try:  # a --tp that cannot shard the model's heads: one line naming the flag
        page_layout(model, dtype, cut)
    except ShardError as exc:
        raise UsageError(f"--tp {tp}: {exc}") from None

    def ms(t: int) -> float:
        return descriptor_ms(link, *counts_at(link, model, dtype, t, cut))

    t1 = aligned_tokens(max(1, fold_tokens), c.block_size)
    per_token = (ms(2 * t1) - ms(t1)) / t1
    return {"us_per_desc": link.us_per_desc, "us_per_merged_desc": link.us_per_merged_desc,
            "cut": {"block_size": c.block_size, "kv_pages": c.kv, "block_ids": c.blocks},
            "ms_constant": ms(t1) - per_token * t1, "ms_per_token": per_token,
            "ms": ms, "counts": lambda t: counts_at(link, model, dtype, t, cut),
            "note": "descriptor ms = constant + per_token x prompt_tokens, exact at whole-block "
                    "prompt lengths below any sliding window"}


def _per_rank_bytes_per_token(model, dtype, tp: int) -> tuple[int, dict]:
    shard = KVSizing(model, dtype, 1, tp=tp).tp_shard()
    return int(shard["bytes_per_rank"]), shard


def kv_transfer_model(link, fit_path: str, model, dtype, tp: int, fold_tokens: int,
                      planned=None, two_hop: dict | None = None) -> KVTransferModel:
    """The tool-neutral `kvbench.kv-transfer-model/1` document, built as its contract:
    every export format is computed from this object only. `two_hop`: a store's handoff
    (kvbench.plan.twohop), kept in `context.two_hop` with the pool's capacity at the fold."""
    desc = descriptor_model(link, model, dtype, tp, planned, fold_tokens)
    doc = _two_terms(link, fit_path, model, dtype, tp, fold_tokens)
    if two_hop is not None:
        pool, kv = two_hop.get("store_pool_bytes"), KVSizing(model, dtype, fold_tokens).kv_bytes
        doc["context"]["two_hop"] = {**two_hop, "capacity_requests_at_fold":
                                     pool // kv if pool and kv else None}
    doc = doc if desc is None else _with_descriptors(doc, fold_tokens, desc)
    return as_contract(KVTransferModel, doc, "the kv-transfer model being written")


def _two_terms(link, fit_path: str, model, dtype, tp: int, fold_tokens: int) -> dict:
    """setup + bytes / rate, as every tool understands it."""
    bpt, shard = _per_rank_bytes_per_token(model, dtype, tp)
    pc = link.for_payload(bpt * fold_tokens)  # the regime at the fold length
    setup, rate = max(pc.cost.setup_ms or 0.0, 0.0), pc.cost.effective_gb_s
    points = sorted({*CHECK_TOKENS, fold_tokens})
    return {
        "schema": SCHEMA_KV_MODEL,
        "formula": "handoff_ms = setup_ms + prompt_tokens x bytes_per_token_per_rank / (effective_gb_s x 1e9) x 1000",
        "setup_ms": setup, "setup_ms_ci95": pc.setup_ci95,
        "effective_gb_s": rate, "effective_gb_s_ci95": pc.rate_ci95,
        "units": "ms; GB/s = 1e9 bytes/s (decimal); bytes exact",
        "bytes_per_token_per_rank": bpt,
        "bytes_per_token_all_ranks": model.bytes_per_token(dtype),
        "tp": tp, "tp_note": shard["note"] or f"KV heads split over {tp} rank(s); each rank moves its shard",
        "model": model.name, "dtype": dtype.name,
        "transport": (link.group or {}).get("transport"), "link": link.label,
        "shape": link.shape,
        "context": {"fit": fit_path, "group": link.group, "regime": pc.regime,
                    "fit_warnings": list(link.fit_warnings), "notes": pc.notes},
        "fold": {"prompt_tokens": fold_tokens,
                 "effective_gb_s_with_setup": folded_gb_s(setup, rate, bpt * fold_tokens)},
        "handoff_ms": {str(t): handoff_ms(setup, bpt * t, rate) for t in points},
    }


def _with_descriptors(doc: dict, fold_tokens: int, desc: dict) -> dict:
    """The model with the per-descriptor term: `handoff_ms` is the three-term model, and the
    `descriptor` section gives what a two-term tool takes, `base_ms` (setup plus the constant
    descriptors) and `rate_gb_s` (bytes and the per-token descriptors as one bandwidth)."""
    ms, counts = desc.pop("ms"), desc.pop("counts")
    points = [int(t) for t in doc["handoff_ms"]]
    bpt, setup, rate = doc["bytes_per_token_per_rank"], doc["setup_ms"], doc["effective_gb_s"]
    per_token_ms = handoff_ms(0.0, bpt, rate) + desc["ms_per_token"]
    base = setup + desc["ms_constant"]
    rate_d = bpt / (per_token_ms / 1000.0) / 1e9
    doc["formula"] = ("handoff_ms = setup_ms + descriptors x us_per_desc / 1000 [+ descriptors "
                      "left after the transport joined adjacent ones x us_per_merged_desc / 1000] "
                      "+ prompt_tokens x bytes_per_token_per_rank / (effective_gb_s x 1e9) x 1000")
    doc["descriptor"] = {**desc, "base_ms": base, "rate_gb_s": rate_d,
                         "descriptors": {str(t): counts(t)[0] for t in points},
                         "descriptors_merged": {str(t): counts(t)[1] for t in points}}
    doc["handoff_ms"] = {str(t): handoff_ms(setup, bpt * t, rate) + ms(t) for t in points}
    doc["fold"]["effective_gb_s_with_setup"] = folded_gb_s(base, rate_d, bpt * fold_tokens)
    return doc


# ---------------------------------------------------------------------------
# the tools, each from the model document


def _descriptor_note(doc: KVTransferModel, where: str) -> str:
    d = doc.descriptor
    return (f"a per-descriptor term: {d.ms_constant:.4g} ms + {d.ms_per_token:.4g} ms x "
            f"prompt_tokens of descriptors at block size {d.cut['block_size']} "
            f"({d.cut['kv_pages']}, {d.cut['block_ids']}): the per-token part is folded "
            f"into the bandwidth ({d.rate_gb_s:.6g} GB/s, exact at whole-block prompts), the "
            f"constant part {where}")


def _rate_for(doc: KVTransferModel, setup_as: str) -> tuple[float, str]:
    d = doc.descriptor
    if setup_as == "drop":
        rate, base = (d.rate_gb_s, d.base_ms) if d else (doc.effective_gb_s, doc.setup_ms)
        return rate, (f"setup_ms {doc.setup_ms:.4g} is dropped: every handoff is "
                      f"predicted {base:.4g} ms short")
    f = doc.fold
    return f.effective_gb_s_with_setup, (
        f"setup_ms {doc.setup_ms:.4g} is folded into an effective {f.effective_gb_s_with_setup:.6g} GB/s, "
        f"exact at {f.prompt_tokens} prompt tokens; shorter prompts are predicted short of the model, "
        "longer ones long")


def _tool_ms(doc: KVTransferModel, effective_gb_s: float, base_ms: float = 0.0) -> dict[str, float]:
    bpt = doc.bytes_per_token_per_rank
    return {t: handoff_ms(base_ms, int(t) * bpt, effective_gb_s) for t in doc.handoff_ms}


def tool_parameters(doc: KVTransferModel, tool: str, setup_as: str = "fold") -> dict:
    """A tool's parameters, what it predicts, and what it cannot represent."""
    bpt, setup, rate = doc.bytes_per_token_per_rank, doc.setup_ms, doc.effective_gb_s
    missing = ["the 95% intervals (a point estimate only)"]
    two_hop = doc.context.get("two_hop")
    if two_hop:
        missing[0:0] = two_hop_notes(two_hop, tool, setup_as,
                                     two_hop.get("capacity_requests_at_fold"), doc.fold.prompt_tokens)
    d = doc.descriptor
    if d:  # the tool takes two terms: setup plus constant descriptors, and one bandwidth
        setup, rate = d.base_ms, d.rate_gb_s
    if tool == "blis":
        params = {"--pd-transfer-bandwidth": rate, "--pd-transfer-base-latency": setup,
                  "--pd-kv-bytes-per-token": bpt}
        predicted = _tool_ms(doc, rate, setup)
        if d:
            missing.insert(0, _descriptor_note(doc, "is in the base latency (exact)"))
    elif tool in ("dynamo", "aisimulate", "splitwise"):
        effective_gb_s, how = _rate_for(doc, setup_as)
        missing.insert(0, "a per-handoff setup term: " + how)
        if d:
            missing.insert(1, _descriptor_note(doc, "goes with setup (" + setup_as + ")"))
        predicted = _tool_ms(doc, effective_gb_s)
        params = _tool_words(tool, effective_gb_s, bpt, missing)
    else:
        raise UsageError(f"unknown tool {tool!r}; choose from {', '.join(TOOLS)}")
    return {"parameters": params, "setup_as": None if tool == "blis" else setup_as,
            "predicted_handoff_ms": predicted,
            "error_vs_model_ms": {t: predicted[t] - doc.handoff_ms[t] for t in predicted},
            "cannot_represent": missing}


def _tool_words(tool: str, effective_gb_s: float, bpt: int, missing: list[str]) -> dict:
    """A tool without a setup term: its own names for the one rate (and bytes per token)."""
    if tool == "dynamo":
        return {"kv_transfer_bandwidth": effective_gb_s, "kv_transfer_bytes_per_token": bpt}
    if tool == "aisimulate":
        return {"bytes_per_token": bpt, "bandwidth_gb_per_second": effective_gb_s,
                "timing_mode": "full_prompt"}
    missing.append("bytes per token: splitwise-sim sizes the KV from its own model config "
                   f"(kvbench's per-rank figure is {bpt} B/token)")
    return {"transfer_bandwidth": effective_gb_s * 1e9 / GIB}


def _comment(lines: Sequence[str]) -> str:
    return "".join(f"# {ln}\n" for ln in lines)


def render(doc: KVTransferModel, tool: str, setup_as: str) -> str:
    """The text to paste into the tool (flags or YAML), with what it cannot represent as comments."""
    if tool == "json":
        tools = {t: tool_parameters(doc, t, setup_as) for t in TOOLS[1:]}
        return dumps_json({**doc.model_dump(mode="json", by_alias=True, exclude_unset=True),
                           "tools": tools}) + "\n"
    tp = tool_parameters(doc, tool, setup_as)
    p = tp["parameters"]
    head = [f"kvbench plan export --to {tool}: {doc.link}",
            f"model {doc.model} {doc.dtype}, TP {doc.tp}: {doc.bytes_per_token_per_rank} B/token per rank; "
            f"fit: setup {doc.setup_ms:.6g} ms + {doc.effective_gb_s:.6g} GB/s",
            *[f"cannot represent: {m}" for m in tp["cannot_represent"]],
            "predicted handoff ms (tool / kvbench model): " + ", ".join(
                f"{t} tokens {tp['predicted_handoff_ms'][t]:.4f} / {doc.handoff_ms[t]:.4f}" for t in doc.handoff_ms)]
    if tool == "dynamo":
        body = dumps_json({"engine": p}) + "\n"
        flags = f"--kv-transfer-bandwidth {p['kv_transfer_bandwidth']!r} --kv-bytes-per-token {p['kv_transfer_bytes_per_token']}"
        return _comment([*head, "python -m dynamo.mocker flags: " + flags,
                         "replay engine args (prefill_engine_args / decode_engine_args, merged into "
                         "each worker's 'engine'):"]) + body
    if tool == "aisimulate":
        return _comment(head) + "engine:\n  kv_transfer:\n" + "".join(
            f"    {k}: {v!r}\n" if not isinstance(v, str) else f"    {k}: {v}\n" for k, v in p.items())
    if tool == "blis":
        return _comment(head) + " ".join(f"{k} {v!r}" for k, v in p.items()) + "\n"
    return _comment([*head, "in the scheduler config (e.g. configs/orchestrator_repo/schedulers/*.yaml); "
                     "transfer_bandwidth is GiB/s (x 2^30 bytes/s)"]) + f"transfer_bandwidth: {p['transfer_bandwidth']!r}\n"
