"""`kvbench slo` / `python -m kvbench.slo`: validate a plan, convert load generators' results, analyze records."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from kvbench.cli import (
    ArgumentParser,
    UsageError,
    arg_float,
    arg_int,
    bounded_float,
    parse_positive_floats,
    run_main,
)
from kvbench.records.requests import dumps_jsonl, iter_records, record_to_json
from kvbench.records.schema.slo import SCHEMA_REPORT, SloReport
from kvbench.records.schema.types import MAX_RATE_RPS, MAX_SECONDS, MAX_TOKENS
from kvbench.records.write import (
    as_contract,
    check_new_file,
    dumps_json,
    new_file_stream,
    write_files,
)
from kvbench.slo import synth
from kvbench.slo.benchplan import BenchmarkPlan, load_benchmark_plan, same_rate
from kvbench.slo.convert import CONVERTERS, INPUTS, cmd_convert
from kvbench.slo.engine_metrics import analyze_scrape, load_scrape
from kvbench.slo.engines import ENGINES, all_known_families, load_mapping
from kvbench.slo.gates import (
    DEFAULT_SEND_LAG_P99_MAX_MS,
    DENOMINATORS,
    NUMERATORS,
    Criteria,
    analyze,
)
from kvbench.slo.report import format_markdown, format_table, plot_format, render_plot
from kvbench.slo.scrape import family_of, parse_endpoint, run_scrape

_EPILOG = """\
examples:
  kvbench slo validate-plan examples/pd-benchmark-plan.yaml
  kvbench slo convert --from vllm vllm-agg-4qps.json --deployment aggregated --out agg-4.jsonl
  kvbench slo convert --from aiperf artifacts/ --deployment disaggregated --out disagg-4.jsonl
  kvbench slo convert --from guidellm benchmarks.json --deployment aggregated --out agg-2.jsonl
  kvbench slo analyze agg-*.jsonl disagg-*.jsonl --plan examples/pd-benchmark-plan.yaml --plot sweep.png
  kvbench slo synth cohort --out cohort.jsonl
  kvbench slo analyze cohort.jsonl --ttft-max-ms 2000 --tpot-max-ms 50 \\
      --denominator all_offered_after_warmup --attainment-min 0.95
  kvbench slo scrape prefill=http://127.0.0.1:18011/metrics decode=http://127.0.0.1:18012/metrics \\
      --interval 1 --duration 120 --out run.metrics.jsonl
  kvbench slo analyze disagg-4.jsonl --plan PLAN.yaml --metrics run.metrics.jsonl --fit link.fit.json

Record format, every output field and the vLLM/AIPerf/GuideLLM definitions: docs/slo.md
"""

# analyze flags that a plan also declares: giving both is ambiguous, so it is refused
_PLAN_FLAGS = ("ttft_max_ms", "tpot_max_ms", "max_itl_ms", "deadline_s", "min_tokens_for_tpot",
               "numerator", "denominator", "attainment_min", "error_rate_max", "warmup_requests",
               "duration_s", "no_queue_check")


_LIMIT_MS = arg_float(0.0, 1e9, lo_open=True)  # per-request limits, ms
_SECONDS = arg_float(0.0, MAX_SECONDS, lo_open=True)
_RATE = arg_float(0.0, MAX_RATE_RPS, lo_open=True)
_WARMUP = arg_int(0, 10**9)
MAX_SYNTH_REQUESTS = 2_000_000  # synth keeps one (deployment, rate) run in memory at a time


def _fraction(text: str) -> float:
    try:  # bounded_float: ASCII digits only, finite, no denormal
        return bounded_float(text, "fraction", 0.0, 1.0)
    except UsageError:
        raise argparse.ArgumentTypeError(f"expected a fraction in 0..1 (0.95 means 95%), got {text!r}") from None


def _convert_args(c, metavar: str) -> None:
    c.add_argument("result", metavar=metavar)
    c.add_argument("--deployment", required=True, help="deployment name for every record")
    c.add_argument("--offered-rate", type=_RATE, help="offered rate in requests/s (default: the run's own rate)")
    c.add_argument("--index", type=arg_int(0, 10**6),
                   help="which result of a vLLM --append-result file, or which benchmark of a GuideLLM report")
    c.add_argument("--cache-state", metavar="STATE",
                   help="the plan's cache state this run was made under (e.g. cold, warm)")
    c.add_argument("--out", metavar="FILE.jsonl", help="write records here (never overwrites); default stdout")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench slo",
                       description="Serving SLO analysis for an equal-budget comparison of aggregated "
                                   "and disaggregated deployments:\nTTFT/TPOT/ITL percentiles, joint "
                                   "attainment, error rate, queue stability, SLO-compliant capacity.",
                       epilog=_EPILOG)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)

    a = sub.add_parser("analyze", help="analyze per-request records (JSONL)", prog="kvbench slo analyze",
                       description="Per deployment and offered rate: latency percentiles, attainment of "
                                   "successful and of all offered requests, gates; then capacity and verdict.")
    a.add_argument("records", nargs="*", metavar="RECORDS.jsonl",
                   help="per-request records (may be left out when --metrics is given)")
    a.add_argument("--plan", metavar="PLAN.yaml", help="take limits, gates, warm-up and window from a plan")
    a.add_argument("--ttft-max-ms", type=_LIMIT_MS, help="per-request TTFT limit in ms")
    a.add_argument("--tpot-max-ms", type=_LIMIT_MS, help="per-request TPOT limit in ms")
    a.add_argument("--max-itl-ms", type=_LIMIT_MS, help="per-request limit on the largest chunk gap in ms")
    a.add_argument("--deadline-s", type=_SECONDS, help="per-request end-to-end deadline in seconds")
    a.add_argument("--min-tokens-for-tpot", type=arg_int(2, MAX_TOKENS),
                   help="TPOT applies from this many output tokens (default 2)")
    a.add_argument("--numerator", choices=list(NUMERATORS), help="default requests_meeting_all_limits")
    a.add_argument("--denominator", choices=list(DENOMINATORS),
                   help="which attainment the gate uses (both are always reported); required without --plan")
    a.add_argument("--attainment-min", type=_fraction, help="gate: minimum attainment, fraction (0.95 = 95%%)")
    a.add_argument("--error-rate-max", type=_fraction, help="gate: maximum error rate, fraction")
    a.add_argument("--warmup-requests", type=_WARMUP, help="requests excluded at the start of each run (default 0)")
    a.add_argument("--duration-s", type=_SECONDS, help="declared measurement window in seconds "
                   "(default: first measured send to last finish)")
    a.add_argument("--no-queue-check", action="store_true", help="do not gate on queue stability")
    a.add_argument("--send-lag-max-ms", type=_LIMIT_MS, default=DEFAULT_SEND_LAG_P99_MAX_MS,
                   help=f"gate: P99 client send lag in ms (default {DEFAULT_SEND_LAG_P99_MAX_MS:g})")
    m = a.add_argument_group("engine metrics (from kvbench slo scrape)")
    m.add_argument("--metrics", action="append", metavar="SCRAPE.jsonl", default=[],
                   help="queue trends and KV-transfer distribution per role (repeatable)")
    m.add_argument("--metrics-window-s", type=arg_float(1e-3, MAX_SECONDS), default=10.0,
                   help="KV-transfer statistics per window of this many seconds (default 10)")
    m.add_argument("--metrics-map", metavar="MAP.yaml", help="metric names of an engine kvbench does "
                   "not know (docs/slo.md)")
    m.add_argument("--fit", metavar="FITTED.json", help="kvbench fit output: show the fitted handoff "
                   "model beside the engine's observed transfers")
    m.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="with --fit: pick the fit group (repeatable)")
    a.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    a.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE (never overwrites)")
    a.add_argument("--plot", metavar="FILE", help="plot attainment and latency percentiles against "
                   "offered rate (.png/.svg/.pdf; needs kvbench[plot])")

    v = sub.add_parser("validate-plan", help="check an equal-budget benchmark plan (YAML)",
                       prog="kvbench slo validate-plan")
    v.add_argument("plan", metavar="PLAN.yaml")

    c = sub.add_parser("convert", help="convert a load generator's per-request export (vLLM, AIPerf, GuideLLM)",
                       prog="kvbench slo convert",
                       description="Write kvbench request records from one run of vllm bench serve, "
                                   "AIPerf or GuideLLM,\nin kvbench's definitions (docs/slo.md section 3).")
    c.add_argument("--from", dest="tool", required=True, choices=list(CONVERTERS),
                   help="; ".join(f"{k}: {v}" for k, v in INPUTS.items()))
    _convert_args(c, "RESULT")
    cv = sub.add_parser("convert-vllm", help="the same as convert --from vllm",
                        prog="kvbench slo convert-vllm")
    _convert_args(cv, "RESULT.json")

    sc = sub.add_parser("scrape", help="record timestamped samples of engines' Prometheus /metrics",
                        prog="kvbench slo scrape",
                        description="Fetch every endpoint each --interval seconds for --duration seconds; "
                                    "parse with prometheus-client;\nan endpoint that fails is recorded as "
                                    "a gap and the run goes on. Output: docs/slo.md.")
    sc.add_argument("endpoints", nargs="+", metavar="ROLE=URL",
                    help="e.g. prefill=http://127.0.0.1:18011/metrics decode=http://127.0.0.1:18012/metrics")
    sc.add_argument("--interval", type=arg_float(0.05, 3600.0), default=1.0, help="seconds between scrapes (default 1)")
    sc.add_argument("--duration", type=_SECONDS, required=True, help="seconds to scrape")
    sc.add_argument("--out", required=True, metavar="FILE.jsonl", help="never overwritten")
    sc.add_argument("--engine", choices=("auto", *ENGINES), default="auto",
                    help="whose metric names to keep (default auto: every known engine's)")
    sc.add_argument("--metrics-map", metavar="MAP.yaml", help="also keep this mapping file's metrics")
    sc.add_argument("--all-metrics", action="store_true", help="keep every sample, not only those kvbench reads")
    sc.add_argument("--deployment", help="label: the deployment scraped")
    sc.add_argument("--offered-rate", type=_RATE, help="label: the offered rate in requests/s")
    sc.add_argument("--cache-state", help="label: the plan's cache state of this run")

    s = sub.add_parser("synth", help="write synthetic records with known answers (no GPU needed)",
                       prog="kvbench slo synth")
    s.add_argument("kind", choices=("cohort", "sweep"),
                   help="cohort: the tutorial's 100 requests; sweep: two toy deployments over rates")
    s.add_argument("--out", required=True, metavar="FILE.jsonl")
    s.add_argument("--plan", metavar="PLAN.yaml", help="sweep: take rates, duration and warm-up from a plan")
    s.add_argument("--rates", default="1,2,3,4,5,6,7,8", help="sweep: offered rates in requests/s")
    s.add_argument("--duration-s", type=_SECONDS, default=120.0, help="sweep: seconds of traffic per rate")
    s.add_argument("--warmup-requests", type=_WARMUP, default=20)
    s.add_argument("--seed", type=arg_int(0, 2**32 - 1), default=0)
    return p


def _criteria_from_flags(args) -> Criteria:
    if args.denominator is None:
        raise UsageError("declare the attainment denominator: --denominator "
                         f"{'|'.join(DENOMINATORS)} (or give --plan)")
    if args.attainment_min is None:
        raise UsageError("declare the attainment gate: --attainment-min FRACTION (or give --plan)")
    return Criteria(
        denominator=args.denominator, slo_attainment_min=args.attainment_min,
        numerator=args.numerator or "requests_meeting_all_limits",
        ttft_max_ms=args.ttft_max_ms, tpot_max_ms=args.tpot_max_ms,
        max_itl_per_request_ms=args.max_itl_ms,
        request_deadline_ms=None if args.deadline_s is None else args.deadline_s * 1000.0,
        output_tokens_minimum_for_tpot=2 if args.min_tokens_for_tpot is None else args.min_tokens_for_tpot,
        error_rate_max=args.error_rate_max, require_no_sustained_queue_growth=not args.no_queue_check,
        warmup_requests=args.warmup_requests or 0, duration_s=args.duration_s,
        send_lag_p99_max_ms=args.send_lag_max_ms)


class _PlanCheck:
    """Records must name the plan's deployments, rates and cache states; collects untested runs."""

    def __init__(self, plan: BenchmarkPlan):
        self.plan, self.tested = plan, set()

    def __call__(self, r) -> None:
        plan, states = self.plan, self.plan.cache_states
        if r.deployment not in plan.deployments:
            raise UsageError(f"{r.where}: deployment {r.deployment!r} is not in the plan "
                             f"({', '.join(plan.deployments)})")
        match = [x for x in plan.offered_rates_rps if same_rate(x, r.offered_rate_rps)]
        if not match:
            raise UsageError(f"{r.where}: offered rate {r.offered_rate_rps:g} rps is not in the plan's "
                             f"offered_rates_rps ({', '.join(f'{x:g}' for x in plan.offered_rates_rps)})")
        state = r.cache_state
        if state is None and len(states) > 1:
            raise UsageError(f"{r.where}: the plan runs every rate once per cache state "
                             f"({', '.join(states)}): the record must say which (cache_state; "
                             "convert --cache-state)")
        if state is not None and state not in states:
            raise UsageError(f"{r.where}: cache state {state!r} is not in the plan's cache_state "
                             f"({', '.join(states)})")
        self.tested.add((state or states[0], r.deployment, match[0]))

    def untested(self) -> list[dict]:
        return [{"cache_state": c, "deployment": d, "offered_rate_rps": x} for c, d, x in self.plan.runs()
                if (c, d, x) not in self.tested]


def _checked(records, check):
    for r in records:
        check(r)
        yield r


def _client_report(args, plan: BenchmarkPlan | None) -> dict:
    """The per-request part of the report (criteria, groups, capacity, verdict), streamed."""
    if plan:
        criteria = Criteria(**{**asdict(plan.criteria), "send_lag_p99_max_ms": args.send_lag_max_ms})
    else:
        criteria = _criteria_from_flags(args)
    check = _PlanCheck(plan) if plan else None
    records = iter_records(args.records)
    budget = (f"at equal budget ({plan.total_gpus} GPUs each, checked by the plan)" if plan
              else "equal budget not checked (no --plan)")
    result = analyze(_checked(records, check) if check else records, criteria, budget)
    return {"criteria": asdict(criteria),
            "equal_budget": ({"total_gpus": plan.total_gpus, "gpus": plan.gpus, "shapes": plan.shapes}
                             if plan else None),
            "untested": check.untested() if check else [],
            **result}


def _fit_link(args):
    """The one fitted link to compare the engine's transfers with (a kvbench.plan.floors.FittedLink)."""
    if not args.fit:
        if args.where:
            raise UsageError("--where selects a group of a --fit file")
        return None
    from kvbench.plan.floors import links_from_fit
    from kvbench.records.select import parse_where

    links = links_from_fit(args.fit, parse_where(args.where))
    if len(links) > 1:
        raise UsageError(f"{args.fit} holds {len(links)} fitted links; pick one with --where KEY=VALUE "
                         f"({'; '.join(link.label for link in links)})")
    return links[0]


def _engine_report(args, plan: BenchmarkPlan | None) -> tuple[list[dict] | None, list[str]]:
    """Engine-metrics analyses (one per scrape file) and notes about what the plan asked for."""
    notes = []
    wanted = [g for g in ("scheduler", "kv_transfer") if plan and g in plan.metrics]
    if wanted and not args.metrics:
        notes.append(f"the plan asks for {' and '.join(wanted)} metrics: record them with "
                     "`kvbench slo scrape` and pass --metrics FILE")
    if not args.metrics:
        if args.fit or args.metrics_map:
            raise UsageError("--fit and --metrics-map apply to --metrics files")
        return None, notes
    mapping = load_mapping(args.metrics_map)[1] if args.metrics_map else None
    link = _fit_link(args)
    return [analyze_scrape(load_scrape(f), mapping, args.metrics_window_s, link) for f in args.metrics], notes


def cmd_analyze(args, argv) -> int:
    if not args.records and not args.metrics:
        raise UsageError("give request records (RECORDS.jsonl), --metrics SCRAPE.jsonl, or both")
    if args.plan:
        given = [f"--{n.replace('_', '-')}" for n in _PLAN_FLAGS if getattr(args, n) not in (None, False)]
        if given:
            raise UsageError(f"{given[0]} conflicts with --plan: the plan declares limits, gates, "
                             "warm-up and window")
    plan = load_benchmark_plan(args.plan) if args.plan else None
    if args.out and args.plot and os.path.abspath(args.out) == os.path.abspath(args.plot):
        raise UsageError(f"--plot {args.plot} is the same file as --out")
    for target in (args.out, args.plot):  # refuse before the work, not after it
        if target:
            check_new_file(target)
    if args.plot and not args.records:
        raise UsageError("--plot draws the per-request analysis: give RECORDS.jsonl")
    fmt = plot_format(Path(args.plot)) if args.plot else None
    engine, notes = _engine_report(args, plan)
    report = {"schema": SCHEMA_REPORT, "command": ["kvbench", "slo", *argv],
              "inputs": {"records": list(args.records), "plan": args.plan, "metrics": list(args.metrics),
                         "fit": args.fit},
              **(_client_report(args, plan) if args.records else {}),
              "engine_metrics": engine, "notes": notes}
    as_contract(SloReport, report, "the report being written")  # a drifting writer fails here
    text = dumps_json(report)
    files = [(args.out, text + "\n")] if args.out else []
    if args.plot:  # rendered before anything is written; JSON and plot appear together or not at all
        files.append((args.plot, render_plot(report, fmt)))
    write_files(files)
    if args.format == "json":
        print(text)
    elif args.format == "markdown":
        print(format_markdown(report))
    else:
        print(format_table(report))
    return 0


def cmd_scrape(args, argv) -> int:
    endpoints = [parse_endpoint(e) for e in args.endpoints]
    roles = [e.role for e in endpoints]
    dup = next((r for r in roles if roles.count(r) > 1), None)
    if dup:
        raise UsageError(f"role {dup!r} given twice: name each endpoint's role once "
                         "(e.g. aggregated-0=URL aggregated-1=URL)")
    if args.duration / args.interval > 1e6:
        raise UsageError("--duration / --interval must be <= 1e6 scrapes")
    check_new_file(args.out)
    families = set(all_known_families() if args.engine == "auto" else
                   {m.name for m in ENGINES[args.engine].values()})
    if args.metrics_map:
        families |= {m.name for m in load_mapping(args.metrics_map)[1].values()}

    def keep(name: str) -> bool:
        return args.all_metrics or family_of(name, families) is not None

    from importlib.metadata import version

    header = {"command": ["kvbench", "slo", *argv], "endpoints": [vars(e) for e in endpoints],
              "interval_s": args.interval, "duration_s": args.duration, "engine": args.engine,
              "deployment": args.deployment, "offered_rate_rps": args.offered_rate,
              "cache_state": args.cache_state, "kept": "all" if args.all_metrics else sorted(families),
              "parser": f"prometheus-client {version('prometheus-client')}"}
    end = run_scrape(endpoints, args.interval, args.duration, Path(args.out), keep, header)
    note = " (interrupted)" if end["interrupted"] else (" (stopped by SIGTERM)" if end.get("stopped") else "")
    print(f"{args.out}: {end['scrapes']} scrapes, {end['gaps']} gaps, {len(endpoints)} endpoint(s) "
          f"over {end['t_s']:.1f} s{note}")
    return 130 if end["interrupted"] else 0


def cmd_validate(args) -> int:
    plan = load_benchmark_plan(args.plan)
    print(f"{args.plan}: valid plan; {plan.summary()}")
    return 0


def _synth_inputs(args) -> tuple[tuple, float, int, tuple]:
    """(rates, duration_s, warm-up requests, cache states) from --plan or the flags, bounded."""
    if args.plan:
        plan = load_benchmark_plan(args.plan)
        states = plan.cache_states if len(plan.cache_states) > 1 else (None,)
        rates, duration, warmup = (plan.offered_rates_rps, plan.criteria.duration_s,
                                   plan.criteria.warmup_requests)
    else:
        rates = tuple(parse_positive_floats(args.rates, "--rates", hi=MAX_RATE_RPS))
        duration, warmup, states = args.duration_s, args.warmup_requests, (None,)
    expected = len(states) * len(synth.TOY_SERVERS) * (sum(rates) * duration + warmup * len(rates))
    if expected > MAX_SYNTH_REQUESTS:
        raise UsageError(f"the sweep asks for about {expected:,.0f} requests (rates x duration x "
                         f"deployments); synth writes at most {MAX_SYNTH_REQUESTS:,}")
    return rates, duration, warmup, states


def cmd_synth(args) -> int:
    check_new_file(args.out)
    if args.kind == "cohort":
        groups = [synth.cohort()]
    else:
        rates, duration, warmup, states = _synth_inputs(args)
        groups = ([replace(r, cache_state=state) for r in synth.sweep([rate], duration, warmup, args.seed + i)]
                  for i, state in enumerate(states) for rate in rates)
    n = 0
    with new_file_stream(args.out) as fh:  # one run in memory at a time; the file appears when done
        for records in groups:
            fh.write(dumps_jsonl(record_to_json(r, {"synthetic": True}) for r in records))
            n += len(records)
    print(f"{args.out}: {n} synthetic records ({args.kind})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "analyze":
        return cmd_analyze(args, argv)
    if args.command == "validate-plan":
        return cmd_validate(args)
    if args.command in ("convert", "convert-vllm"):
        return cmd_convert(args, "vllm" if args.command == "convert-vllm" else args.tool)
    if args.command == "scrape":
        return cmd_scrape(args, argv)
    return cmd_synth(args)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_main("kvbench slo", main, argv)
