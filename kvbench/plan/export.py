"""`kvbench plan export`: a fitted handoff model in the words of the tools planners use.

    kvbench plan export --fit run.fit.json --to dynamo|aisimulate|blis|splitwise|json \\
        [--model M] [--dtype D] [--tp N] [--fold-at-tokens 2000] [--setup-as fold|drop] [--out F]

One tool-neutral document, `kvbench.kv-transfer-model/1`, is built first (setup_ms and
effective GB/s with their 95% intervals, bytes per token per TP rank, transport, link and
where it came from); every tool's fragment is derived from it, never from the fit directly:

    handoff_ms(tokens) = setup_ms + tokens x bytes_per_token_per_rank / (GB/s x 1e9) x 1000

Each rank moves its own shard over its own link in parallel, so the per-rank bytes set the
time. A tool that has no setup term gets either the setup folded into an effective rate
that is exact at one stated prompt length (`--setup-as fold`, the default) or the bandwidth
term alone (`--setup-as drop`); the fragment says which and what it misses elsewhere.
Parameter names are checked against each tool's sources (docs/planners.md cites them).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int, run_main
from kvbench.model import DEFAULT_MODEL, DTYPES, PRESETS, KVSizing, get_dtype, resolve_model
from kvbench.records.schema.types import MAX_TOKENS
from kvbench.records.write import check_new_file, dumps_json, write_new_file

SCHEMA_MODEL = "kvbench.kv-transfer-model/1"
TOOLS = ("json", "dynamo", "aisimulate", "blis", "splitwise")
CHECK_TOKENS = (500, 2000, 8000)
GIB = 2**30


def handoff_ms(setup_ms: float, gb_s: float, nbytes: float) -> float:
    return setup_ms + nbytes / (gb_s * 1e9) * 1000.0


def folded_gb_s(setup_ms: float, gb_s: float, nbytes: int) -> float:
    """The rate that moves nbytes in exactly setup + nbytes/rate: setup folded in at that size."""
    return nbytes / (handoff_ms(setup_ms, gb_s, nbytes) / 1000.0) / 1e9


def _per_rank_bytes_per_token(model, dtype, tp: int) -> tuple[int, dict]:
    shard = KVSizing(model, dtype, 1, tp=tp).tp_shard()
    return int(shard["bytes_per_rank"]), shard


def transfer_model(link, fit_path: str, model, dtype, tp: int, fold_tokens: int) -> dict:
    """The tool-neutral model: every export format is computed from this document only."""
    bpt, shard = _per_rank_bytes_per_token(model, dtype, tp)
    cost, regime, notes, s_ci, r_ci = link.for_payload(bpt * fold_tokens)  # regime at the fold length
    setup = max(cost.setup_ms or 0.0, 0.0)
    points = sorted({*CHECK_TOKENS, fold_tokens})
    return {
        "schema": SCHEMA_MODEL,
        "formula": "handoff_ms = setup_ms + prompt_tokens x bytes_per_token_per_rank / (effective_gb_s x 1e9) x 1000",
        "setup_ms": setup, "setup_ms_ci95": s_ci,
        "effective_gb_s": cost.effective_gb_s, "effective_gb_s_ci95": r_ci,
        "units": "ms; GB/s = 1e9 bytes/s (decimal); bytes exact",
        "bytes_per_token_per_rank": bpt,
        "bytes_per_token_all_ranks": model.bytes_per_token(dtype),
        "tp": tp, "tp_note": shard["note"] or f"KV heads split over {tp} rank(s); each rank moves its shard",
        "model": model.name, "dtype": dtype.name,
        "transport": (link.group or {}).get("transport"), "link": link.label,
        "shape": link.shape,
        "context": {"fit": fit_path, "group": link.group, "regime": regime, "fit_warnings": link.fit_warnings,
                    "notes": notes},
        "fold": {"prompt_tokens": fold_tokens,
                 "effective_gb_s_with_setup": folded_gb_s(setup, cost.effective_gb_s, bpt * fold_tokens)},
        "handoff_ms": {str(t): handoff_ms(setup, cost.effective_gb_s, bpt * t) for t in points},
    }


# ---------------------------------------------------------------------------
# the tools, each from the model document


def _rate_for(doc: dict, setup_as: str) -> tuple[float, str]:
    if setup_as == "drop":
        return doc["effective_gb_s"], (f"setup_ms {doc['setup_ms']:.4g} is dropped: every handoff is "
                                       f"predicted {doc['setup_ms']:.4g} ms short")
    f = doc["fold"]
    return f["effective_gb_s_with_setup"], (
        f"setup_ms {doc['setup_ms']:.4g} is folded into an effective {f['effective_gb_s_with_setup']:.6g} GB/s, "
        f"exact at {f['prompt_tokens']} prompt tokens; shorter prompts are predicted short of the model, "
        "longer ones long")


def _tool_ms(doc: dict, gb_s: float, base_ms: float = 0.0) -> dict[str, float]:
    bpt = doc["bytes_per_token_per_rank"]
    return {t: base_ms + int(t) * bpt / (gb_s * 1e9) * 1000.0 for t in doc["handoff_ms"]}


def tool_parameters(doc: dict, tool: str, setup_as: str = "fold") -> dict:
    """A tool's parameters, what it predicts, and what it cannot represent."""
    bpt, setup, rate = doc["bytes_per_token_per_rank"], doc["setup_ms"], doc["effective_gb_s"]
    missing = ["the 95% intervals (a point estimate only)"]
    if tool == "blis":
        params = {"--pd-transfer-bandwidth": rate, "--pd-transfer-base-latency": setup,
                  "--pd-kv-bytes-per-token": bpt}
        predicted = _tool_ms(doc, rate, setup)
    elif tool in ("dynamo", "aisimulate", "splitwise"):
        gb_s, how = _rate_for(doc, setup_as)
        missing.insert(0, "a per-handoff setup term: " + how)
        predicted = _tool_ms(doc, gb_s)
        if tool == "dynamo":
            params = {"kv_transfer_bandwidth": gb_s, "kv_transfer_bytes_per_token": bpt}
        elif tool == "aisimulate":
            params = {"bytes_per_token": bpt, "bandwidth_gb_per_second": gb_s, "timing_mode": "full_prompt"}
        else:
            params = {"transfer_bandwidth": gb_s * 1e9 / GIB}
            missing.append("bytes per token: splitwise-sim sizes the KV from its own model config "
                           f"(kvbench's per-rank figure is {bpt} B/token)")
    else:
        raise UsageError(f"unknown tool {tool!r}; choose from {', '.join(TOOLS)}")
    return {"parameters": params, "setup_as": None if tool == "blis" else setup_as,
            "predicted_handoff_ms": predicted,
            "error_vs_model_ms": {t: predicted[t] - doc["handoff_ms"][t] for t in predicted},
            "cannot_represent": missing}


def _comment(lines: Sequence[str]) -> str:
    return "".join(f"# {ln}\n" for ln in lines)


def render(doc: dict, tool: str, setup_as: str) -> str:
    """The text to paste into the tool (flags or YAML), with what it cannot represent as comments."""
    if tool == "json":
        tools = {t: tool_parameters(doc, t, setup_as) for t in TOOLS[1:]}
        return dumps_json({**doc, "tools": tools}) + "\n"
    tp = tool_parameters(doc, tool, setup_as)
    p = tp["parameters"]
    head = [f"kvbench plan export --to {tool}: {doc['link']}",
            f"model {doc['model']} {doc['dtype']}, TP {doc['tp']}: {doc['bytes_per_token_per_rank']} B/token per rank; "
            f"fit: setup {doc['setup_ms']:.6g} ms + {doc['effective_gb_s']:.6g} GB/s",
            *[f"cannot represent: {m}" for m in tp["cannot_represent"]],
            "predicted handoff ms (tool / kvbench model): " + ", ".join(
                f"{t} tokens {tp['predicted_handoff_ms'][t]:.4f} / {doc['handoff_ms'][t]:.4f}" for t in doc["handoff_ms"])]
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


# ---------------------------------------------------------------------------
# CLI (`kvbench plan export`, hooked into kvbench.plan)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench plan export",
                       description="Write a fitted handoff model as a planning tool's parameters.\n"
                                   "Source of every format: the kvbench.kv-transfer-model/1 JSON (--to json).",
                       epilog="examples:\n  kvbench plan export --fit results/run.fit.json --to blis --tp 4\n"
                              "  kvbench plan export --fit results/run.fit.json --to dynamo --fold-at-tokens 2000\n"
                              "Details and each tool's sources: docs/planners.md")
    p.add_argument("--fit", required=True, metavar="FITTED.json", help="output of kvbench fit")
    p.add_argument("--where", action="append", metavar="KEY=VALUE", help="pick the fit group (repeatable)")
    p.add_argument("--pair", default=None, metavar="slowest|I,J",
                   help="with a kvbench matrix file: the slowest pair (default) or pair I,J")
    p.add_argument("--to", required=True, choices=TOOLS, help="the tool to write for")
    p.add_argument("--model", default=None, help=f"preset (default {DEFAULT_MODEL}): {', '.join(PRESETS)}")
    p.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json")
    p.add_argument("--dtype", default="bf16", help=f"KV element type: {', '.join(DTYPES)}")
    p.add_argument("--tp", type=arg_int(1, 65_536), default=1, help="tensor-parallel size of prefill and decode (default 1)")
    p.add_argument("--fold-at-tokens", type=arg_int(1, MAX_TOKENS), default=2000,
                   help="prompt length at which a folded rate is exact (default 2000)")
    p.add_argument("--setup-as", choices=("fold", "drop"), default="fold",
                   help="for tools without a setup term: fold it into the rate, or drop it (default fold)")
    p.add_argument("--out", metavar="FILE", help="also write to FILE (never overwrites)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from kvbench.fit.fitting import parse_where
    from kvbench.plan.floors import links_from_fit

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.out:
        check_new_file(args.out)
    links = links_from_fit(args.fit, parse_where(args.where), args.pair)
    if len(links) > 1:
        raise UsageError(f"{args.fit} holds {len(links)} fitted links; pick one with --where KEY=VALUE "
                         f"({'; '.join(link.label for link in links)})")
    model = resolve_model(args.model, args.model_config)
    doc = transfer_model(links[0], args.fit, model, get_dtype(args.dtype), args.tp, args.fold_at_tokens)
    text = render(doc, args.to, args.setup_as)
    if args.out:
        write_new_file(Path(args.out), text)
    sys.stdout.write(text)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench plan export", main, argv)
