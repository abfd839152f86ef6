"""`kvbench plan` / `python -m kvbench.plan`: the plan, route and export commands and their flags."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from kvbench.cli import (
    FORMAT_HELP,
    ArgumentParser,
    UsageError,
    arg_int,
    bounded_float,
    output_format,
    parse_positive_ints,
    run_main,
)
from kvbench.model import (
    DEFAULT_BUDGET_MS,
    DEFAULT_MODEL,
    DEFAULT_PROMPT_TOKENS,
    DTYPES,
    PRESETS,
    RATE_FLAGS,
    SCALE_DTYPES,
    SCALE_MODES,
    TOKENS_FLAGS,
    KVSizing,
    get_dtype,
    resolve_model,
)
from kvbench.plan.export import TOOLS, kv_transfer_model, render
from kvbench.plan.floors import (
    MAX_MS,
    _f,
    descriptor_term_left_out,
    format_plan_table,
    plan_rows,
    resolve_links,
)
from kvbench.plan.route import (
    HANDOFF_MODES,
    breakeven,
    decide,
    exposed_ms,
    interference_at,
)
from kvbench.records.schema.plan import SCHEMA_PLAN, SCHEMA_ROUTE, PlanDocument, RouteDocument
from kvbench.records.schema.types import MAX_TOKENS
from kvbench.records.write import check_new_file, contract_dump, dumps_json, write_new_file
from kvbench.tutorial import plan_labels, route_labels
from kvbench.units import round_places

# ---------------------------------------------------------------------------
# the argument groups plan, plan route and plan export share: each built by one function, so a
# flag the commands have in common has one spelling, one help and one check. The link: a fit
# (--fit, --where, --pair) or rates typed in (--gbps ...: plan and route; export writes a fit).
# The payload: the model, the prompt lengths (--prompt-tokens, also spelt --sizes as in
# kvbench p2p; plan and route) and the block size. The cut: --kv-pages, --block-ids (and
# --tp-pair, which export leaves out: it writes one rank's model with --tp).

MAX_BLOCK_SIZE = 1 << 20


class Group(Protocol):
    """A parser or one of its argument groups (what add_argument is called on)."""

    def add_argument(self, *args, **kwargs) -> argparse.Action: ...


def add_fit_flags(g: Group, required: bool = False) -> None:
    """The fitted link: the fit file, its group and (for a matrix) its pair."""
    g.add_argument("--fit", required=required, metavar="FITTED.json", help="output of kvbench fit")
    g.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="with --fit: only groups whose KEY equals VALUE (repeatable)")
    g.add_argument("--pair", default=None, metavar="slowest|I,J",
                   help="with --fit of a kvbench matrix file: plan with the slowest pair a route "
                        "may take (default) or with pair I,J (sender rank I, receiver rank J)")


def add_rate_flags(g: Group) -> None:
    """A link typed in: its rate, setup and per-descriptor cost."""
    g.add_argument(*RATE_FLAGS, dest="gbps", metavar="R[,R...]",
                   help="sustained effective rate(s) in decimal GB/s")
    g.add_argument("--setup-ms", default=None, metavar="MS", help="with --gbps: setup per handoff")
    g.add_argument("--includes-setup", action="store_true",
                   help="with --gbps: the rate was measured end to end and already contains "
                        "setup (setup is then never added)")
    g.add_argument("--us-per-desc", default=None, metavar="US",
                   help="with --gbps: the cost of one descriptor in microseconds (a fit of "
                        "several cuts carries its own: docs/descriptors.md)")


def add_link_group(p: ArgumentParser) -> None:
    """plan and route: a fit, or rates typed in."""
    g = p.add_argument_group("link (one of)")
    add_fit_flags(g)
    add_rate_flags(g)


def add_model_flags(g: Group) -> None:
    """Which model's KV, in which element type."""
    g.add_argument("--model", default=None, help=f"preset (default {DEFAULT_MODEL}): "
                   f"{', '.join(PRESETS)}")
    g.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json")
    g.add_argument("--dtype", default="bf16", help=f"KV element type: {', '.join(DTYPES)}")


def add_tokens_flag(g: Group, required: bool) -> None:
    """The prompt lengths (`--sizes` as kvbench p2p spells them)."""
    g.add_argument(*TOKENS_FLAGS, dest="prompt_tokens", metavar="N[,N...]", required=required,
                   default=None if required else str(DEFAULT_PROMPT_TOKENS),
                   help="prompt length(s) in tokens" + ("" if required else
                                                        f" (default {DEFAULT_PROMPT_TOKENS})"))


def add_block_size_flag(g: Group) -> None:
    g.add_argument("--block-size", type=arg_int(1, MAX_BLOCK_SIZE), default=None,
                   help="paged block size in tokens (allocation rounded up to whole blocks; "
                        "with a per-descriptor term, the blocks a handoff posts)")


def add_cut_group(p: ArgumentParser, tp_pair: bool = True) -> None:
    """The deployment's cut, for links with a per-descriptor term."""
    c = p.add_argument_group("the cut (links with a per-descriptor term: docs/descriptors.md)")
    c.add_argument("--kv-pages", default=None, choices=("joint", "split"),
                   help="K and V of a block in one page (joint, default) or in two regions")
    c.add_argument("--block-ids", default=None, metavar="IDS",
                   help="contiguous (default), scattered or merged block ids")
    if tp_pair:
        c.add_argument("--tp-pair", default=None, metavar="P:D",
                       help="prefill TP : decode TP (default 1:1): P > D cuts each block into "
                            "P/D pieces; bytes are then one decode rank's share")


def add_payload_group(p: ArgumentParser, tokens_required: bool) -> None:
    """plan and route: the model, the prompt lengths, scales and block size."""
    g = p.add_argument_group("payload")
    add_model_flags(g)
    add_tokens_flag(g, tokens_required)
    g.add_argument("--scale-mode", default="none", choices=SCALE_MODES,
                   help="FP8/INT8 scale overhead (default none)")
    g.add_argument("--scale-dtype", default="fp32", choices=list(SCALE_DTYPES))
    add_block_size_flag(g)
    add_cut_group(p)


def _sizings(args) -> tuple:
    model = resolve_model(args.model, args.model_config)
    dtype = get_dtype(args.dtype)
    tokens = parse_positive_ints(args.prompt_tokens, "--prompt-tokens", hi=MAX_TOKENS)
    sizings = [KVSizing(model, dtype, t, args.scale_mode, args.scale_dtype, args.block_size)
               for t in tokens]
    return model, dtype, sizings


_EPILOG = """\
examples:
  kvbench plan --fit results/run.fit.json --model seed-70b-gqa --prompt-tokens 300,2000,8192
  kvbench plan --gbps 100,25,10 --setup-ms 1 --prompt-tokens 2000 --format table
  kvbench plan --gbps 8 --includes-setup --prompt-tokens 2000     # an end-to-end rate
  kvbench plan --fit sweep.fit.json --prompt-tokens 2000 --block-size 16 --tp-pair 2:1
  kvbench plan route --gbps 10 --setup-ms 1 --prompt-tokens 300 \\
      --local-interference-ms 2 --itl-p95-ms 35 --itl-target-ms 50
"""


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kvbench plan",
        description="Handoff floors per link and prompt length, with budget verdicts and, where "
                    "the fit's input measured\nthat exact payload, the measured p50/p99 beside "
                    "the floor. `kvbench plan route --help` for routing.",
        epilog=_EPILOG,
    )
    add_link_group(p)
    add_payload_group(p, tokens_required=False)
    p.add_argument("--budget-ms", default=DEFAULT_BUDGET_MS,
                   help="handoff budget in ms (default %(default)s)")
    p.add_argument("--format", choices=("json", "table"), default=None, help=FORMAT_HELP)
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (never overwrites)")
    return p


_ROUTE_EPILOG = """\
The tutorial's short-prompt case:
  kvbench plan route --gbps 10 --setup-ms 1 --prompt-tokens 300 \\
      --local-interference-ms 2 --itl-p95-ms 35 --itl-target-ms 50 --format table
"""


def build_route_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="kvbench plan route",
        description="Keep a request's prefill local, or hand its KV to a remote prefill worker?\n"
                    "Compares the (exposed) handoff floor with the local prefill interference "
                    "it would replace,\nand asks whether the aggregated baseline misses its "
                    "ITL target at all.",
        epilog=_ROUTE_EPILOG,
    )
    add_link_group(p)
    add_payload_group(p, tokens_required=True)
    g = p.add_argument_group("serving evidence")
    g.add_argument("--local-interference-ms", required=True, metavar="MS",
                   help="decode stall one local prefill of this prompt causes (per request)")
    g.add_argument("--interference-at-tokens", type=arg_int(1, MAX_TOKENS), default=None,
                   metavar="N",
                   help="the prompt length that interference was measured at: scale it "
                        "linearly to other lengths (default: the same for every length)")
    g.add_argument("--itl-p95-ms", required=True, metavar="MS",
                   help="P95 inter-token latency of the aggregated (all-local) baseline")
    g.add_argument("--itl-target-ms", required=True, metavar="MS", help="the ITL P95 target")
    g.add_argument("--handoff", choices=HANDOFF_MODES, default="sequential",
                   help="sequential: the whole handoff is exposed; overlapped: layer-by-layer "
                        "sends hide behind prefill except the last layer (default sequential)")
    p.add_argument("--format", choices=("json", "table"), default=None, help=FORMAT_HELP)
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (never overwrites)")
    return p


def _emit(doc: dict, table: str, args) -> None:
    text = dumps_json(doc)
    if args.out:
        write_new_file(Path(args.out), text + "\n")
    print(table if output_format(args.format) == "table" else text)


def _check_out(args) -> None:
    if args.out:  # before any work: an existing file or an unwritable folder is one line
        check_new_file(args.out)


def _given_link(links) -> tuple[list[float] | None, float | None, float | None]:
    """(rates, setup, us per descriptor) of the links given as numbers (--gbps), or Nones
    for a fit (measured)."""
    user = [link for link in links if link.source == "user"]
    if not user:
        return None, None, None
    return [link.effective_gb_s for link in user], user[0].setup_ms, user[0].us_per_desc


def _labelled(table: str, labels: list[str]) -> str:
    """The table with what kvbench did not measure said under its first line."""
    head, _, rest = table.partition("\n")
    return "\n".join([head] + [f"  not measured: {label}" for label in labels]
                     + ([rest] if rest else []))


def plan_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    _check_out(args)
    budget = bounded_float(args.budget_ms, "--budget-ms", 0, MAX_MS, lo_open=True)
    notes: list[str] = []  # said once the plan is out: a refusal is one line
    links = resolve_links(args, notes)
    model, dtype, sizings = _sizings(args)
    doc = contract_dump(PlanDocument, {
        "schema": SCHEMA_PLAN,
        "scope": "lower bound on one prefill->decode KV handoff: setup plus bytes at a "
                 "sustained effective rate; excludes queueing, contention and retries",
        "source": args.fit or "user",
        "model": model.name,
        "dtype": dtype.name,
        "budget_ms": budget,
        "rows": plan_rows(links, sizings, budget, planned_cut(args)),
        "not_measured": plan_labels(model.name, *_given_link(links), budget),
    }, "the plan being written")
    _emit(doc, _labelled(format_plan_table(doc), doc["not_measured"]), args)
    say_notes("kvbench plan", notes)
    return 0


def say_notes(prog: str, notes: list[str]) -> None:
    for note in notes:
        print(f"{prog}: note: {note}", file=sys.stderr)


def planned_cut(args):
    """The deployment's cut from the flags (kvbench.plan.descriptors), or None."""
    from kvbench.plan.descriptors import PlannedCut

    return PlannedCut.from_args(args.block_size, args.kv_pages, args.block_ids, args.tp_pair)


def route_main(argv: Sequence[str]) -> int:
    args = build_route_parser().parse_args(argv)
    _check_out(args)
    interference = bounded_float(args.local_interference_ms, "--local-interference-ms", 0, MAX_MS)
    p95 = bounded_float(args.itl_p95_ms, "--itl-p95-ms", 0, MAX_MS)
    target = bounded_float(args.itl_target_ms, "--itl-target-ms", 0, MAX_MS, lo_open=True)
    notes: list[str] = []
    links = resolve_links(args, notes)
    if getattr(args, "us_per_desc", None) is not None:  # the decision counts no descriptors
        raise UsageError("--us-per-desc: plan route does not count descriptors; plan the cut "
                         "with `kvbench plan --block-size ...`")
    model, dtype, sizings = _sizings(args)
    interf = interference_at(interference, args.interference_at_tokens)

    decisions, crossings = [], []
    for link in links:
        for sz in sizings:
            pc = link.for_payload(sz.kv_bytes)
            d = decide(sz.tokens, sz.kv_bytes, model.layers, pc.cost, interf(sz.tokens), p95,
                       target, args.handoff).to_dict()
            d = {k: round_places(v) if isinstance(v, float) else v for k, v in d.items()}
            d.update(link=link.label, regime=pc.regime,
                     notes=pc.notes + descriptor_term_left_out(link))
            decisions.append(d)

        def f(t: int, link=link) -> float:
            kv = KVSizing(model, dtype, t, args.scale_mode, args.scale_dtype,
                          args.block_size).kv_bytes
            cost = link.for_payload(kv).cost
            return exposed_ms(kv, model.layers, cost, args.handoff)[2] - interf(t)

        crossings.append({"link": link.label, **breakeven(f).to_dict()})
    doc = contract_dump(RouteDocument, {
        "schema": SCHEMA_ROUTE,
        "source": args.fit or "user",
        "model": model.name,
        "dtype": dtype.name,
        "handoff": args.handoff,
        "local_interference_ms": interference,
        "interference_at_tokens": args.interference_at_tokens,
        "itl_p95_ms": p95,
        "itl_target_ms": target,
        "decisions": decisions,
        "breakeven": crossings,
        "not_measured": route_labels(model.name, *_given_link(links), interference, p95, target),
    }, "the routing decision being written")
    _emit(doc, format_route_table(doc), args)
    say_notes("kvbench plan route", notes)
    return 0


def format_route_table(doc: dict) -> str:
    lines = [f"kvbench plan route: {doc['model']} {doc['dtype']}, {doc['handoff']} handoff, "
             f"baseline ITL P95 {doc['itl_p95_ms']:g} ms vs target {doc['itl_target_ms']:g} ms"]
    lines += [f"  not measured: {label}" for label in doc.get("not_measured", [])]
    for d in doc["decisions"]:
        lines.append("")
        lines.append(f"{d['prompt_tokens']} tokens ({d['kv_bytes']:,} B) over {d['link']}:")
        lines.append(f"  verdict  {d['verdict']}")
        versus = (f"(exposed handoff {_f(d['exposed_handoff_ms'], '.4f')} ms vs local "
                  f"interference {_f(d['local_interference_ms'], 'g')} ms)")
        if d["added_ms"] is not None:
            lines.append(f"  adds at least {_f(d['added_ms'], '.4f')} ms {versus}")
        else:
            lines.append(f"  saves at most {_f(d['saved_ms'], '.4f')} ms {versus}")
        lines.append(f"  reason   {d['reason']}")
        for n in d["notes"]:
            lines.append(f"  note     {n}")
    lines.append("")
    for c in doc["breakeven"]:
        t = c["prompt_tokens"]
        lines.append(f"breakeven over {c['link']}: remote floor below local interference for "
                     f"{c['remote_floor_below_interference_for']}"
                     + (f" (threshold {t:,} tokens)" if t is not None else "")
                     + f"; {c['note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# `kvbench plan export` (the document and the tools' words: kvbench.plan.export)


def build_export_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench plan export",
                       description="Write a fitted handoff model as a planning tool's parameters.\n"
                                   "Source of every format: the kvbench.kv-transfer-model/1 JSON (--to json).",
                       epilog="examples:\n  kvbench plan export --fit results/run.fit.json --to blis --tp 4\n"
                              "  kvbench plan export --fit results/run.fit.json --to dynamo --fold-at-tokens 2000\n"
                              "Details and each tool's sources: docs/planners.md")
    add_fit_flags(p.add_argument_group("link"), required=True)
    p.add_argument("--to", required=True, choices=TOOLS, help="the tool to write for")
    g = p.add_argument_group("payload")
    add_model_flags(g)
    g.add_argument("--tp", type=arg_int(1, 65_536), default=1,
                   help="tensor-parallel size of prefill and decode (default 1)")
    g.add_argument("--fold-at-tokens", type=arg_int(1, MAX_TOKENS), default=DEFAULT_PROMPT_TOKENS,
                   help="prompt length at which a folded rate is exact (default %(default)s)")
    g.add_argument("--setup-as", choices=("fold", "drop"), default="fold",
                   help="for tools without a setup term: fold it into the rate, or drop it "
                        "(default fold)")
    add_block_size_flag(g)
    add_cut_group(p, tp_pair=False)
    p.add_argument("--out", metavar="FILE", help="also write to FILE (never overwrites)")
    return p


def export_main(argv: Sequence[str] | None = None) -> int:
    from kvbench.plan.descriptors import PlannedCut
    from kvbench.plan.floors import links_from_fit
    from kvbench.plan.twohop import store_handoff
    from kvbench.records.select import parse_where

    args = build_export_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.out:
        check_new_file(args.out)
    notes: list[str] = []  # said once the export is written: a refusal is one line
    links, two_hop = store_handoff(links_from_fit(args.fit, parse_where(args.where), args.pair, notes))
    if len(links) > 1:
        raise UsageError(f"{args.fit} holds {len(links)} fitted links; pick one with --where KEY=VALUE "
                         f"({'; '.join(link.label for link in links)})")
    model = resolve_model(args.model, args.model_config)
    planned = PlannedCut.from_args(args.block_size, args.kv_pages, args.block_ids, None)
    doc = kv_transfer_model(links[0], args.fit, model, get_dtype(args.dtype), args.tp,
                            args.fold_at_tokens, planned, two_hop)
    text = render(doc, args.to, args.setup_as)
    if args.out:
        write_new_file(Path(args.out), text)
    sys.stdout.write(text)
    say_notes("kvbench plan export", notes)
    return 0


def export_cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench plan export", export_main, argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "route":
        return route_main(argv[1:])
    if argv and argv[0] == "export":  # kvbench/plan/export.py: the fit in planning tools' words
        return export_main(argv[1:])
    return plan_main(argv)


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = {"route": "kvbench plan route", "export": "kvbench plan export"}.get(argv[0] if argv else "",
                                                                                "kvbench plan")
    return run_main(prog, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
