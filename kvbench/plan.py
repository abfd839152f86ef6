"""Handoff floors, budget verdicts and the routing decision, from fitted (or given) link numbers.

    kvbench plan --fit FITTED.json --model M --prompt-tokens 300,2000,8192 --budget-ms 20
    kvbench plan --gbps 100,25,10 --setup-ms 1 --prompt-tokens 2000
    kvbench plan route --gbps 10 --setup-ms 1 --prompt-tokens 300 \\
        --local-interference-ms 2 --itl-p95-ms 35 --itl-target-ms 50

    KV_bytes           from kvbench.model (geometry x dtype x tokens, scales, blocks)
    bandwidth_floor_ms = KV_bytes / (effective_gb_s x 1e9) x 1000
    handoff_floor_ms   = setup_ms + bandwidth_floor_ms

A fitted rate excludes setup by construction. A rate given with --includes-setup was
measured end to end and already contains it: setup is then never added again.
See docs/fit-and-plan.md for every output field.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbench.cli import (
    ArgumentParser,
    UsageError,
    arg_int,
    bounded_float,
    parse_positive_floats,
    parse_positive_ints,
    run_main,
)
from kvbench.fit import SCHEMA_FIT, matches, min_samples_for, parse_where
from kvbench.fit_data import not_link_reason
from kvbench.model import (
    DEFAULT_MODEL,
    DTYPES,
    PRESETS,
    SCALE_DTYPES,
    SCALE_MODES,
    KVSizing,
    get_dtype,
    resolve_model,
)
from kvbench.results import check_new_file, dumps_json, write_new_file
from kvbench.route import HANDOFF_MODES, LinkCost, breakeven, decide, exposed_ms, interference_at
from kvbench.schema.fit import load_fit_document
from kvbench.schema.types import MAX_GBPS, MAX_TOKENS, MIN_GBPS

SCHEMA_PLAN = "kvbench.plan/1"
MAX_MS = 1e7  # any time given in ms (setup, budget, interference, ITL): ~3 hours
SCHEMA_ROUTE = "kvbench.route/1"


# ---------------------------------------------------------------------------
# links: from a fit file or from the command line


@dataclass
class Link:
    label: str
    source: str  # "fit" or "user"
    effective_gb_s: float
    setup_ms: float | None
    includes_setup: bool = False
    group: dict | None = None
    setup_ci95: list | None = None
    rate_ci95: list | None = None
    sizes: list[dict] = field(default_factory=list)
    two_regimes: dict | None = None
    fit_warnings: list[str] = field(default_factory=list)
    draws: np.ndarray | None = None  # (B, 2) joint draws of (setup_ms, ms_per_gb) from the fit
    no_band: str | None = None  # why there are no draws

    def _regime(self, kv_bytes: int) -> tuple[str, dict | None]:
        tr = self.two_regimes
        if not tr:
            return "single", None
        regime = "large" if kv_bytes >= tr["break_bytes"] else "small"
        part = tr[regime]
        return (regime, part) if part.get("effective_gb_s") else ("single", None)

    def for_payload(self, kv_bytes: int) -> tuple[LinkCost, str, list[str], list | None,
                                                  list | None]:
        """The link cost for this payload: the right regime, setup never negative; with that
        regime's setup and rate intervals (marginal: for a band use `band`)."""
        notes: list[str] = []
        rate, setup = self.effective_gb_s, self.setup_ms
        s_ci, r_ci = self.setup_ci95, self.rate_ci95
        regime, part = self._regime(kv_bytes)
        if part is not None:
            rate, setup = part["effective_gb_s"], part["setup_ms"]
            s_ci, r_ci = part.get("setup_ms_ci95"), part.get("effective_gb_s_ci95")
            notes.append(f"two regimes: used the {regime}-message fit "
                         f"(break near {self.two_regimes['break_bytes']:,} B)")
        if setup is not None and setup < 0:
            notes.append(f"fitted setup {setup:.4g} ms is negative; used 0")
            setup = 0.0
        lo = int(part["bytes_min"]) if part else None
        hi = int(part["bytes_max"]) if part else None
        if self.source == "fit" and self.sizes:
            lo = lo if lo is not None else min(int(r["bytes"]) for r in self.sizes)
            hi = hi if hi is not None else max(int(r["bytes"]) for r in self.sizes)
            if kv_bytes > hi or kv_bytes < lo:
                notes.append(f"payload outside the measured sizes ({lo:,} .. {hi:,} B): "
                             "extrapolated")
        return LinkCost(rate, setup, self.includes_setup), regime, notes, s_ci, r_ci

    def band(self, kv_bytes: int) -> list[float] | None:
        """95% band of the handoff floor at this payload from the fit's joint draws of
        (setup, slope): each draw's floor (its setup used as 0 when negative, like the point
        estimate's), then the 2.5 and 97.5 percentiles. None without draws."""
        _, part = self._regime(kv_bytes)
        draws = _draws(part.get("draws")) if part is not None else self.draws
        if draws is None or not len(draws):
            return None
        floor = np.maximum(draws[:, 0], 0.0) + draws[:, 1] * kv_bytes / 1e9
        lo, hi = np.percentile(floor, [2.5, 97.5])
        return [_r(float(lo)), _r(float(hi))]

    def measured(self, kv_bytes: int) -> dict | None:
        for row in self.sizes:
            if int(row["bytes"]) == kv_bytes:
                return row
        return None


def _draws(d: dict | None) -> np.ndarray | None:
    if not d or not d.get("values"):
        return None
    arr = np.asarray(d["values"], dtype=float)
    return arr[np.all(np.isfinite(arr), axis=1)]


def load_fit(path: str) -> dict:
    """A fit file through the typed, bounded fit model (kvbench.schema.fit): every field plan
    computes with is finite and of its type, so no NaN, infinity, denormal rate or string
    reaches the arithmetic or the table; any problem is one line naming the key path."""
    return load_fit_document(path).model_dump(by_alias=True)


def _group_not_link(g: dict) -> str | None:
    """A kvbench.fit/1 file fitted every group; the link rules of kvbench fit apply here too."""
    if g.get("fit_as_link") is False:
        return "not a link"
    return not_link_reason({k: v for k, v in (g.get("group") or {}).items() if k != "bytes"})


def _link_of(g: dict, schema: str) -> Link:
    draws = _draws(g.get("draws"))
    why = None
    if draws is None:
        why = (g.get("no_interval") or "no joint draws") if schema == SCHEMA_FIT else \
            f"{schema} fit file has no joint draws: run kvbench fit again for a band"
    return Link(
        label=str(g.get("label")), source="fit", effective_gb_s=float(g["effective_gb_s"]),
        setup_ms=float(g.get("setup_ms") or 0.0), group=g.get("group"),
        setup_ci95=g.get("setup_ms_ci95"), rate_ci95=g.get("effective_gb_s_ci95"),
        sizes=list(g.get("sizes") or []), two_regimes=g.get("two_regimes"),
        fit_warnings=[w.get("code", "?") for w in g.get("warnings", [])], draws=draws,
        no_band=why)


def _chosen_groups(doc: dict, path: str, where: dict[str, str]) -> list[dict]:
    groups = doc["groups"]
    if not groups:
        raise UsageError(f"{path}: the fit holds no groups")
    keys = sorted({k for g in groups for k in (g.get("group") or {})})
    unknown = [k for k in where if k not in keys]
    if unknown:
        raise UsageError(f"--where: unknown key {unknown[0]!r}; group keys are {', '.join(keys)}")
    chosen = [g for g in groups if matches(g.get("group") or {}, where)]
    if not chosen:
        raise UsageError(f"no group in {path} matches "
                         f"{' '.join(f'{k}={v}' for k, v in where.items())} (groups: "
                         + "; ".join(str(g.get("label")) for g in groups) + ")")
    return chosen


def links_from_fit(path: str, where: dict[str, str]) -> list[Link]:
    """Every matching group that is a link with a fitted rate; the rest named in one note."""
    doc = load_fit(path)
    links, skipped = [], [f"[{s.get('label')}] ({s.get('reason')})"
                          for s in doc.get("skipped") or []
                          if not where or matches(s.get("group") or {}, where)]
    for g in _chosen_groups(doc, path, where):
        rate, why = g.get("effective_gb_s"), _group_not_link(g)
        if why is None and not (isinstance(rate, (int, float)) and rate > 0):
            why = "no fitted rate: " + (", ".join(w.get("code", "?") for w in g.get("warnings", []))
                                        or "no rate")
        if why:
            skipped.append(f"[{g.get('label')}] ({why})")
            continue
        links.append(_link_of(g, doc["schema"]))
    if not links:
        raise UsageError(f"no matching group in {path} is a link with a fitted rate: "
                         f"{'; '.join(skipped)}")
    if skipped:
        print(f"kvbench plan: note: skipped group(s): {'; '.join(skipped)}", file=sys.stderr)
    return links


def user_links(gbps: str, setup_ms: str | None, includes_setup: bool) -> list[Link]:
    rates = parse_positive_floats(gbps, "--gbps", MIN_GBPS, MAX_GBPS)
    if includes_setup:
        if setup_ms is not None:
            raise UsageError("--setup-ms with --includes-setup would count setup twice: an "
                             "end-to-end rate already contains it")
        return [Link(f"{r:g} GB/s end to end (includes setup)", "user", r, None, True)
                for r in rates]
    if setup_ms is None:
        raise UsageError("--gbps needs --setup-ms (or --includes-setup for a rate measured "
                         "end to end)")
    setup = bounded_float(setup_ms, "--setup-ms", 0, MAX_MS)
    return [Link(f"{r:g} GB/s + {setup:g} ms setup", "user", r, setup) for r in rates]


def resolve_links(args) -> list[Link]:
    where = parse_where(args.where)
    if args.fit and args.gbps:
        raise UsageError("use either --fit or --gbps, not both")
    if args.fit:
        if args.includes_setup:
            raise UsageError("--includes-setup is for a user-supplied end-to-end rate; a fitted "
                             "rate excludes setup by construction")
        if args.setup_ms is not None:
            raise UsageError("--setup-ms is for --gbps; with --fit the fitted setup is used")
        return links_from_fit(args.fit, where)
    if where:
        raise UsageError("--where selects groups of a --fit file")
    if not args.gbps:
        raise UsageError("give the link: --fit FITTED.json, or --gbps R[,R...] with --setup-ms S")
    return user_links(args.gbps, args.setup_ms, args.includes_setup)


# ---------------------------------------------------------------------------
# the floors


def _r(x: float | None, nd: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)


def plan_rows(links: list[Link], sizings: list[KVSizing], budget_ms: float) -> list[dict]:
    rows = []
    for link in links:
        for sz in sizings:
            kv = sz.kv_bytes
            cost, regime, notes, _, _ = link.for_payload(kv)
            band = link.band(kv) if link.source == "fit" else None
            if link.source == "fit" and band is None:
                notes = notes + [f"no band: {link.no_band}"]
            bw, floor = cost.handoff_floor(kv)
            m = link.measured(kv)
            rows.append({
                "link": link.label,
                "source": link.source,
                "group": link.group,
                "prompt_tokens": sz.tokens,
                "kv_bytes": kv,
                "effective_gb_s": cost.effective_gb_s,
                "includes_setup": cost.includes_setup,
                "setup_ms": None if cost.includes_setup else _r(cost.setup_ms),
                "bandwidth_floor_ms": _r(bw),
                "handoff_floor_ms": _r(floor),
                "handoff_floor_ms_band95": band,
                "budget_ms": budget_ms,
                "within_budget": floor <= budget_ms,
                "measured_p50_ms": m["p50_ms"] if m else None,
                "measured_p99_ms": m["p99_ms"] if m and m["n"] >= min_samples_for(0.99) else None,
                "measured_n": m["n"] if m else None,
                "regime": regime,
                "fit_warnings": link.fit_warnings,
                "notes": notes,
            })
    return rows


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _band_text(band) -> str:
    return "-" if not band else f"{band[0]:.4f}..{band[1]:.4f}"


def _p99_text(r: dict) -> str:
    if r["measured_p99_ms"] is None and r["measured_n"]:
        return f"n<{min_samples_for(0.99)}"
    return _f(r["measured_p99_ms"], ".4f")


def _plan_row_line(r: dict) -> str:
    setup = "in rate" if r["includes_setup"] else _f(r["setup_ms"], ".4f")
    return (f"  {r['prompt_tokens']:>7} {r['kv_bytes']:>15,} {_f(r['effective_gb_s'], '.4g'):>9} "
            f"{setup:>9} {_f(r['bandwidth_floor_ms'], '.4f'):>12} "
            f"{_f(r['handoff_floor_ms'], '.4f'):>11} "
            f"{_band_text(r['handoff_floor_ms_band95']):>19} "
            f"{'ok' if r['within_budget'] else 'OVER':>7} "
            f"{_f(r['measured_p50_ms'], '.4f'):>9} {_p99_text(r):>9} "
            f"{_f(r['measured_n'], 'd'):>5}")


def format_plan_table(doc: dict) -> str:
    """One block per link; a note every row of a link shares is printed once under its header."""
    lines = [f"kvbench plan: {doc['model']} {doc['dtype']}, budget {doc['budget_ms']:g} ms; "
             "handoff_floor_ms = setup_ms + bandwidth_floor_ms (a lower bound); 95% band from "
             "the fit's joint draws"]
    by_link: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        by_link.setdefault(r["link"], []).append(r)
    for link, rows in by_link.items():
        common = [n for n in rows[0]["notes"] if all(n in r["notes"] for r in rows)]
        warn = rows[0]["fit_warnings"]
        lines += ["", f"link: {link}" + (f"  [fit warnings: {', '.join(warn)}]" if warn else "")]
        lines += [f"  note: {n}" for n in common]
        lines.append(f"  {'tokens':>7} {'KV bytes':>15} {'GB/s':>9} {'setup ms':>9} "
                     f"{'bw floor ms':>12} {'handoff ms':>11} {'95% band ms':>19} "
                     f"{'budget':>7} {'meas p50':>9} {'meas p99':>9} {'n':>5}")
        for r in rows:
            lines.append(_plan_row_line(r))
            lines += [f"      note: {n}" for n in r["notes"] if n not in common]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI


def _add_link_args(p: ArgumentParser) -> None:
    g = p.add_argument_group("link (one of)")
    g.add_argument("--fit", metavar="FITTED.json", help="output of kvbench fit")
    g.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="with --fit: only groups whose KEY equals VALUE (repeatable)")
    g.add_argument("--gbps", metavar="R[,R...]", help="sustained effective rate(s) in decimal GB/s")
    g.add_argument("--setup-ms", default=None, metavar="MS", help="with --gbps: setup per handoff")
    g.add_argument("--includes-setup", action="store_true",
                   help="with --gbps: the rate was measured end to end and already contains "
                        "setup (setup is then never added)")


def _add_model_args(p: ArgumentParser, tokens_required: bool) -> None:
    g = p.add_argument_group("payload")
    g.add_argument("--model", default=None, help=f"preset (default {DEFAULT_MODEL}): "
                   f"{', '.join(PRESETS)}")
    g.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json")
    g.add_argument("--dtype", default="bf16", help=f"KV element type: {', '.join(DTYPES)}")
    g.add_argument("--prompt-tokens", metavar="N[,N...]", required=tokens_required,
                   default=None if tokens_required else "2000",
                   help="prompt length(s) in tokens" + ("" if tokens_required else
                                                        " (default 2000)"))
    g.add_argument("--scale-mode", default="none", choices=SCALE_MODES,
                   help="FP8/INT8 scale overhead (default none)")
    g.add_argument("--scale-dtype", default="fp32", choices=list(SCALE_DTYPES))
    g.add_argument("--block-size", type=arg_int(1, 1 << 20), default=None,
                   help="paged block size in tokens (allocation rounded up to whole blocks)")


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
    _add_link_args(p)
    _add_model_args(p, tokens_required=False)
    p.add_argument("--budget-ms", default="20", help="handoff budget in ms (default 20)")
    p.add_argument("--format", choices=("json", "table"), default="json")
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
    _add_link_args(p)
    _add_model_args(p, tokens_required=True)
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
    p.add_argument("--format", choices=("json", "table"), default="json")
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (never overwrites)")
    return p


def _emit(doc: dict, table: str, args) -> None:
    text = dumps_json(doc)
    if args.out:
        write_new_file(Path(args.out), text + "\n")
    print(table if args.format == "table" else text)


def _check_out(args) -> None:
    if args.out:  # before any work: an existing file or an unwritable folder is one line
        check_new_file(args.out)


def plan_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    _check_out(args)
    budget = bounded_float(args.budget_ms, "--budget-ms", 0, MAX_MS, lo_open=True)
    links = resolve_links(args)
    model, dtype, sizings = _sizings(args)
    doc = {
        "schema": SCHEMA_PLAN,
        "scope": "lower bound on one prefill->decode KV handoff: setup plus bytes at a "
                 "sustained effective rate; excludes queueing, contention and retries",
        "source": args.fit or "user",
        "model": model.name,
        "dtype": dtype.name,
        "budget_ms": budget,
        "rows": plan_rows(links, sizings, budget),
    }
    _emit(doc, format_plan_table(doc), args)
    return 0


def route_main(argv: Sequence[str]) -> int:
    args = build_route_parser().parse_args(argv)
    _check_out(args)
    interference = bounded_float(args.local_interference_ms, "--local-interference-ms", 0, MAX_MS)
    p95 = bounded_float(args.itl_p95_ms, "--itl-p95-ms", 0, MAX_MS)
    target = bounded_float(args.itl_target_ms, "--itl-target-ms", 0, MAX_MS, lo_open=True)
    links = resolve_links(args)
    model, dtype, sizings = _sizings(args)
    interf = interference_at(interference, args.interference_at_tokens)

    decisions, crossings = [], []
    for link in links:
        for sz in sizings:
            cost, regime, notes, _, _ = link.for_payload(sz.kv_bytes)
            d = decide(sz.tokens, sz.kv_bytes, model.layers, cost, interf(sz.tokens), p95,
                       target, args.handoff).to_dict()
            d = {k: _r(v) if isinstance(v, float) else v for k, v in d.items()}
            d.update(link=link.label, regime=regime, notes=notes)
            decisions.append(d)

        def f(t: int, link=link) -> float:
            kv = KVSizing(model, dtype, t, args.scale_mode, args.scale_dtype,
                          args.block_size).kv_bytes
            cost = link.for_payload(kv)[0]
            return exposed_ms(kv, model.layers, cost, args.handoff)[2] - interf(t)

        crossings.append({"link": link.label, **breakeven(f).to_dict()})
    doc = {
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
    }
    _emit(doc, format_route_table(doc), args)
    return 0


def format_route_table(doc: dict) -> str:
    lines = [f"kvbench plan route: {doc['model']} {doc['dtype']}, {doc['handoff']} handoff, "
             f"baseline ITL P95 {doc['itl_p95_ms']:g} ms vs target {doc['itl_target_ms']:g} ms"]
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "route":
        return route_main(argv[1:])
    if argv and argv[0] == "export":  # kvbench/export.py: the fit in planning tools' words
        from kvbench.export import main as export_main

        return export_main(argv[1:])
    return plan_main(argv)


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = {"route": "kvbench plan route", "export": "kvbench plan export"}.get(argv[0] if argv else "",
                                                                                "kvbench plan")
    return run_main(prog, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
