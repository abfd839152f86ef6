"""The point-to-point KV handoff benchmark. Run it under MPI:

    mpirun -n 2 python -m kvbench.p2p --sizes 300,2000,8192

Rank 0 plays the prefill worker, rank 1 the decode worker (patterns with more ranks say
how they split them). For each size it allocates a real KV cache, hands it over again and
again, checks every element once, and reports p50/p95/p99 handoff times and GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvbench import mpi_world, patterns, transports
from kvbench.baseline import LABELS, baseline_gbps
from kvbench.cli import (
    EXIT_USAGE,
    ArgumentParser,
    UsageError,
    arg_float,
    arg_int,
    parse_positive_ints,
)
from kvbench.devices import make_device
from kvbench.engine import Engine, close_links
from kvbench.gpu_select import select_local_gpu
from kvbench.harness import (
    LoopResult,
    LoopSettings,
    Progress,
    critical_paths,
    estimate_clock,
    measure,
    notice_latency_ms,
)
from kvbench.model import PRESETS, KVSizing, get_dtype, resolve_model
from kvbench.patterns.base import PatternContext, Point
from kvbench.results import SCHEMA_P2P, check_destination, environment, utc_stamp, write_records
from kvbench.schema.types import MAX_BYTES, MAX_TOKENS
from kvbench.spec import HandoffSpec, model_key, spec_id_of
from kvbench.stats import min_samples_for, percentile_cell
from kvbench.transports.base import TransportContext, TransportError
from kvbench.units import GB, GiB, MiB, gb_per_s, parse_bytes
from kvbench.watchdog import EXIT_STALLED, PHASES, WATCHDOG, slug

PROG = "kvbench p2p"
P2P_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8")
DEFAULT_SIZES = "300,2000,8192"
DEFAULT_TIMEOUT = 120.0
DEFAULT_MIN_ITERS = 5
MAX_ITERS = 10**6
MAX_SECONDS = 86_400.0  # a day: a --timeout or --seconds-per-point beyond it is a typo
MAX_SIZES = 256  # points in one run

_EPILOG = """\
how it times:
  The receiver pre-posts every receive; both ranks meet at a barrier; the sender takes t0,
  (packs and) posts every send; the receiver waits for every byte (on GPU: synchronises its
  stream), unpacks into its own cache, and sends a 1-byte completion notice; the sender
  takes t1 when the notice arrives. Samples are t1 - t0 on the sender's clock. The notice's
  one-way latency is measured separately and recorded as notice_ms. The first handoff of
  each point is reported as cold_ms (lazy connection set-up, registration) and kept out of
  the samples; --warmup more handoffs follow, then the timed ones. After timing, the
  receiver wipes its copy, one more handoff runs, and every element is checked.

examples:
  mpirun -n 2 python -m kvbench.p2p                               # 300,2000,8192 tokens
  mpirun -n 2 python -m kvbench.p2p --transport gloo --granularity layer
  mpirun -n 2 python -m kvbench.p2p --layout paged --block-size 16 --granularity block --sizes 512
  mpirun -n 2 python -m kvbench.p2p --bytes 4K,1M,64M             # raw link sweep
  mpirun -n 2 python -m kvbench.p2p -b 1M -e 256M -f 4 --baseline # vs bare mpi4py Send/Recv
"""


def build_parser(rank: int = 0) -> ArgumentParser:
    class _Parser(ArgumentParser):
        def error(self, message):  # only rank 0 speaks; every rank exits the same way
            if rank == 0:
                print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
            raise SystemExit(EXIT_USAGE)

        def print_help(self, file=None):
            if rank == 0:
                super().print_help(file)

    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 2)[2],
                epilog=_EPILOG)
    what = p.add_argument_group("what moves")
    what.add_argument("--sizes", default=None, metavar="TOKENS",
                      help="prompt lengths in tokens, comma-separated (default 300,2000,8192)")
    what.add_argument("--bytes", default=None, metavar="SIZES",
                      help="raw message sizes instead of tokens, e.g. 4K,1M,64M (binary suffixes)")
    what.add_argument("-b", "--minbytes", default=None, help="raw sweep start, e.g. 1M (with -e, -f)")
    what.add_argument("-e", "--maxbytes", default=None, help="raw sweep end, e.g. 256M")
    what.add_argument("-f", "--stepfactor", type=arg_int(2, 1024), default=2,
                      help="raw sweep multiplier (default 2)")
    what.add_argument("--model", default=None, help=f"model preset (default seed-70b-gqa): {', '.join(PRESETS)}")
    what.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json instead")
    what.add_argument("--dtype", default="bf16", help=f"KV dtype: {', '.join(P2P_DTYPES)} (FP8 moves as bytes)")
    what.add_argument("--layout", choices=("contiguous", "paged"), default="contiguous",
                      help="contiguous per-layer tensors, or paged blocks scattered in a pool")
    what.add_argument("--block-size", type=arg_int(1, 1 << 20), default=16,
                      help="paged block size in tokens (default 16)")
    what.add_argument("--pack-kernel", choices=("torch", "cuda"), default="torch",
                      help="how a paged KV is packed for layer/whole messages on a GPU: torch "
                           "index ops (default) or the CUDA kernels in cuda/kv_pack.cu (needs CuPy)")
    what.add_argument("--device", choices=("auto", "cpu", "cuda", "cpu-async"), default="auto",
                      help="where the KV lives (default: cuda when a GPU is visible, else cpu); "
                           "cpu-async: CPU memory with a CUDA-stream-like queue, to test the "
                           "protocol's device ordering without a GPU (its times mean nothing)")
    how = p.add_argument_group("how it moves")
    how.add_argument("--transport", default="auto",
                     help="auto (nccl on GPU, mpi otherwise), or one of: "
                          + ", ".join(f"{n} ({c.description})" for n, c in transports.available().items()))
    how.add_argument("--pattern", default="sequential",
                     help="comma-separated handoff patterns: " + ", ".join(patterns.available()))
    how.add_argument("--allow-shared-gpu", action="store_true",
                     help="let two ranks of a node use one GPU (refused by default: a handoff "
                          "inside one device measures no link)")
    how.add_argument("--granularity", choices=("whole", "layer", "block"), default="whole",
                     help="one packed message, one per layer tensor, or one per paged block")
    timing = p.add_argument_group("timing")
    timing.add_argument("--order", choices=("rounds", "blocks"), default="rounds",
                        help="rounds (default): each round times every size and variant once, in "
                             "a rotating order, so drifting load falls on all alike; blocks: all "
                             "samples of one size back to back (less memory: one size at a time)")
    timing.add_argument("--clock", choices=("auto", "pingpong"), default="auto",
                        help="one timeline for every rank: auto = shared perf_counter on one "
                             "host, ping-pong offset estimates across hosts; pingpong = always "
                             "estimate (records the offsets and their uncertainty)")
    timing.add_argument("--warmup", type=arg_int(0, MAX_ITERS), default=2,
                        help="untimed handoffs after the cold one (default 2)")
    timing.add_argument("--iters", type=arg_int(1, MAX_ITERS), default=20,
                        help="timed handoffs per point (default 20; p95 needs >= 20, p99 >= 100)")
    timing.add_argument("--min-iters", type=arg_int(1, MAX_ITERS), default=None,
                        help="never fewer timed handoffs (default 5, or --iters if smaller)")
    timing.add_argument("--seconds-per-point", type=arg_float(0, MAX_SECONDS, lo_open=True),
                        default=5.0,
                        help="cut --iters so the timed handoffs take about this long per point "
                             "(default 5; with --order rounds the budget of all points is "
                             "shared, so 300,2000,8192 tokens get all 20 rounds on a 5 GB/s link)")
    timing.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="verify every received element after timing (default on)")
    timing.add_argument("--timeout", type=arg_float(0, MAX_SECONDS, lo_open=True), default=DEFAULT_TIMEOUT,
                        help="seconds any wait on another rank may take before the job is "
                             "aborted, in every phase from MPI start-up to tear-down (default 120)")
    timing.add_argument("--baseline", action="store_true",
                        help="also time a yardstick on the same bytes and print the ratio: bare "
                             "mpi4py Send/Recv (host memory), same-GPU and GPU-to-GPU copies (cuda)")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="results", help="directory for the .jsonl/.csv records (default results/)")
    out.add_argument("--no-write", action="store_true", help="print the table only, write no files")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # Fault injection for the test suite: proves the data check and the timeout really bite.
    p.add_argument("--debug-corrupt-elements", type=arg_int(0, 1 << 40), default=0, help=argparse.SUPPRESS)
    p.add_argument("--debug-stall-rank", type=arg_int(0, 1 << 20), default=None, help=argparse.SUPPRESS)
    # SIGSTOP one rank as it enters a phase (RANK:PHASE, phases as in kvbench.watchdog.PHASES)
    p.add_argument("--debug-stop", type=stop_spec, default=None, help=argparse.SUPPRESS)
    for cls in transports.available().values():
        cls.add_arguments(p)
    for cls in patterns.available().values():
        cls.add_arguments(p)
    return p


# ---------------------------------------------------------------------------
# validation: computed identically on every rank, then agreed collectively


def stop_spec(text: str) -> tuple[int, str]:
    """--debug-stop RANK:PHASE (a test hook: that rank SIGSTOPs itself entering PHASE)."""
    rank, _, phase = str(text).partition(":")
    phases = [slug(p) for p in PHASES]
    if not (rank.isdigit() and len(rank) < 8) or phase not in phases:
        raise argparse.ArgumentTypeError(f"expects RANK:PHASE with PHASE one of "
                                         f"{', '.join(phases)}, got {text!r}")
    return int(rank), phase


def prescan(argv: Sequence[str]) -> tuple[float, tuple[int, str] | None]:
    """(--timeout, --debug-stop) read before MPI starts, so the start-up is bounded too. A value
    that does not parse is left to the full parse, which refuses it once MPI is up."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for flag in ("--timeout", "--debug-stop"):
            if arg == flag and i + 1 < len(argv):
                found[flag] = argv[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg.split("=", 1)[1]
    timeout, stop = DEFAULT_TIMEOUT, None
    try:
        if "--timeout" in found:
            timeout = arg_float(0, MAX_SECONDS, lo_open=True)(found["--timeout"])
        if "--debug-stop" in found:
            stop = stop_spec(found["--debug-stop"])
    except argparse.ArgumentTypeError:
        pass
    return timeout, stop


def _byte_size(text: str, what: str) -> int:
    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from None
    if not 1 <= n <= MAX_BYTES:
        raise UsageError(f"{what}: byte sizes must be positive and at most 2^53 - 1, got {text!r}")
    return n


def raw_sizes(args) -> list[int] | None:
    """The --bytes list or the -b/-e/-f sweep (None: token sizes). Every size is 1 .. 2^53-1
    bytes, so a sweep ends (-b 0 used to repeat size 0 forever) after at most 53 steps."""
    if args.bytes is not None:
        items = [t.strip() for t in args.bytes.split(",")]
        if not any(items):
            raise UsageError("--bytes: empty list")
        sizes = [_byte_size(t, "--bytes") for t in items]
    elif args.minbytes is not None or args.maxbytes is not None:
        lo = _byte_size(args.minbytes if args.minbytes is not None else args.maxbytes, "-b/--minbytes")
        hi = _byte_size(args.maxbytes if args.maxbytes is not None else args.minbytes, "-e/--maxbytes")
        if hi < lo:
            raise UsageError("-e/--maxbytes must not be below -b/--minbytes")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= args.stepfactor
    else:
        return None
    if len(sizes) > MAX_SIZES:
        raise UsageError(f"--bytes: at most {MAX_SIZES} sizes in one run, got {len(sizes)}")
    return sizes


def token_sizes(args) -> list[int]:
    text = DEFAULT_SIZES if args.sizes is None else args.sizes
    tokens = parse_positive_ints(text, "--sizes", hi=MAX_TOKENS)
    if len(tokens) > MAX_SIZES:
        raise UsageError(f"--sizes: at most {MAX_SIZES} sizes in one run, got {len(tokens)}")
    return tokens


def iteration_counts(args) -> None:
    """--min-iters defaults to 5, or to --iters when that is smaller (--iters 3 runs 3); an
    explicit --min-iters above --iters is refused rather than silently winning."""
    if args.min_iters is None:
        args.min_iters = min(DEFAULT_MIN_ITERS, args.iters)
    elif args.min_iters > args.iters:
        raise UsageError(f"--min-iters {args.min_iters} is above --iters {args.iters}: the run "
                         "would time more handoffs than asked; lower --min-iters or raise --iters")


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cpu-async":
        return requested
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return requested


def validate(args, world_size: int):
    """Everything that can be checked before allocating. Raises UsageError."""
    raws = (args.bytes, args.minbytes, args.maxbytes)
    if args.sizes is not None and any(v is not None for v in raws):
        raise UsageError("give either --sizes (tokens) or --bytes/-b/-e (raw bytes), not both")
    iteration_counts(args)
    raw = raw_sizes(args)
    tokens = None if raw else token_sizes(args)
    model = resolve_model(args.model, args.model_config)
    if args.dtype not in P2P_DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r}; choose from {', '.join(P2P_DTYPES)}")
    dtype = get_dtype(args.dtype)
    for t in tokens or ():  # refuses a KV beyond 2^53 bytes before anything is sized
        KVSizing(model, dtype, t, block_size=args.block_size if args.layout == "paged" else None)
    if raw and args.granularity != "whole":
        raise UsageError("--bytes sweeps move one message per handoff: use --granularity whole")
    device = resolve_device(args.device)
    if args.pack_kernel == "cuda":
        from kvbench.cuda_kernels import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise UsageError(reason)
        if device != "cuda" or args.layout != "paged":
            raise UsageError("--pack-kernel cuda packs paged blocks on a GPU: use it with "
                             "--device cuda --layout paged")
    tcls = transport_class(args.transport, device)
    pclasses = pattern_classes(args, world_size, model)
    points = [Point(raw_bytes=b) for b in raw] if raw else [Point(prompt_tokens=t) for t in tokens]
    return model, dtype, device, tcls, pclasses, points


def transport_class(name: str, device: str):
    if name == "auto":
        name = "nccl" if device == "cuda" else "mpi"
    try:
        tcls = transports.get(name)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if tcls.gpu_only and device != "cuda":
        raise UsageError(f"transport {name} needs a GPU: --device cuda (no GPU here?)")
    reason = tcls.unavailable_reason(device)
    if reason:
        raise UsageError(f"transport {name}: {reason}")
    return tcls


def pattern_classes(args, world_size: int, model) -> list:
    pnames = [p.strip() for p in args.pattern.split(",") if p.strip()]
    if not pnames:
        raise UsageError(f"--pattern: empty list; choose from {', '.join(patterns.available())}")
    pclasses = []
    for pn in pnames:
        try:
            pclasses.append(patterns.get(pn))
        except KeyError as exc:
            raise UsageError(str(exc.args[0])) from None
    if world_size < 2:
        raise UsageError("run under MPI with at least 2 ranks, e.g. mpirun -n 2 python -m kvbench.p2p")
    for pc in pclasses:
        err = pc.layout_error(args, world_size, model)
        if err:
            raise UsageError(err)
    return pclasses


def mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def agree(comm, error: UsageError | str | None) -> UsageError | None:
    """Every rank learns the first error any rank hit, and its exit status (2, or 3 for an
    I/O failure), so all can exit together."""
    mine = None if error is None else (str(error), getattr(error, "exit_code", EXIT_USAGE))
    errors = comm.allgather(mine)
    hit = [(rank, e) for rank, e in enumerate(errors) if e]
    if not hit:
        return None
    rank, (message, code) = hit[0]
    if len({e[0] for _, e in hit}) > 1:
        message = f"rank {rank}: {message}"
    exc = UsageError(message)
    exc.exit_code = code
    return exc


# ---------------------------------------------------------------------------
# records and table


NOT_LINK_ZERO = "moves no bytes"


def make_spec(common: dict, pattern, fields: dict) -> HandoffSpec:
    """The record's frozen 'what was measured' (everything but the payload size)."""
    prefill, decode = pattern.roles()
    return HandoffSpec(**common, pattern=pattern.name, variant=fields.get("variant"),
                       granularity=fields["granularity"],
                       pack_kernel=pattern.ctx.args.pack_kernel if fields.get("packed") else None,
                       world={"size": len(common["hosts"]), "prefill_ranks": prefill,
                              "decode_ranks": decode},
                       **pattern.spec_fields())


def make_record(base: dict, point: Point, fields: dict, notice_ms: float | None) -> dict:
    loop: LoopResult = fields.pop("loop")
    s = loop.samples
    nbytes = fields["bytes"]
    if nbytes == 0:
        fields["fit_as_link"], fields["not_link_reason"] = False, NOT_LINK_ZERO
    rec = {
        "schema": SCHEMA_P2P,
        **base,
        "prompt_tokens": point.prompt_tokens,
        **fields,
        "iters": loop.iters,
        "n_samples": len(s),
        "samples_ms": s.samples_ms,
        "sample_rounds": loop.rounds,
        **s.summary(),
        "gbps": gb_per_s(nbytes, s.p50),
        "gbps_best": gb_per_s(nbytes, s.min),
        "cold_ms": loop.cold_ms,
        "warmup_ms": loop.warmup_ms,
        "notice_ms": notice_ms,
    }
    return rec


def format_table(records: list[dict]) -> str:
    w = max([11] + [len(r["pattern"]) + 1 + len(r["variant"]) for r in records if r.get("variant")])
    head = (f"{'pattern':<{w}} {'transport':<9} {'gran':<6} {'tokens':>7} {'bytes':>14} {'MiB':>9} "
            f"{'n':>4} {'p50 ms':>9} {'p95 ms':>11} {'p99 ms':>12} {'GB/s':>7} {'cold ms':>9} "
            f"{'wrong':>6}")
    lines = [head, "-" * len(head)]
    for r in records:
        tok = "-" if r["prompt_tokens"] is None else str(r["prompt_tokens"])
        wrong = "-" if r["wrong"] is None else str(r["wrong"])
        variant = r.get("variant")
        name = r["pattern"] + (f"/{variant}" if variant else "")
        n = r["n_samples"]
        # a bytes/time rate only where the record is a transfer (not compute, not summed edges)
        rate = f"{_num(r['gbps'] if r.get('fit_as_link', True) else None, '.2f'):>7}"
        lines.append(
            f"{name:<{w}} {r['transport']:<9} {r['granularity']:<6} {tok:>7} {r['bytes']:>14,} "
            f"{r['bytes'] / MiB:>9.1f} {n:>4} {r['p50_ms']:>9.3f} "
            f"{percentile_cell(r['p95_ms'], 95, n):>11} {percentile_cell(r['p99_ms'], 99, n):>12} "
            f"{rate} {_num(r['cold_ms'], '.3f'):>9} {wrong:>6}")
        if r.get("table_note"):
            lines.append(f"    {r['table_note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# main


def choose_order(comm, args, pats, points, hosts, device) -> tuple[str | None, str | None, str | None]:
    """(order, note, error). Rounds keep every size's data alive at once: when that does not fit
    but one size at a time does, measure in blocks and say so in one line; when even one size
    does not fit, refuse. Estimated per host, before allocating, against MemAvailable."""
    rank = comm.Get_rank()
    alive = [p.bytes_per_rank(pt) for p in pats for pt in points]
    need = {"rounds": sum(alive), "blocks": max(alive)}
    free = mem_available_bytes()
    if device == "cuda" or free is None:
        return args.order, None, None
    fits = {}
    for order, mine in need.items():
        per_host: dict[str, int] = {}
        for h, n in zip(hosts, comm.allgather(mine), strict=True):
            per_host[h] = per_host.get(h, 0) + n
        fits[order] = per_host[hosts[rank]] <= 0.9 * free
        need[order] = per_host[hosts[rank]]
    fits = {k: all(comm.allgather(v)) for k, v in fits.items()}
    if not fits["blocks"]:
        return None, None, (f"payload would not fit in memory on {hosts[rank]}: the ranks there "
                            f"need about {need['blocks'] / GB:.1f} GB, {free / GB:.1f} GB is "
                            "available; use smaller --sizes or fewer ranks per host")
    if args.order == "rounds" and not fits["rounds"]:
        return "blocks", (f"note: every size at once needs about {need['rounds'] / GB:.1f} GB on "
                          f"{hosts[rank]}, {free / GB:.1f} GB is available: measuring one size at "
                          "a time (--order blocks) instead"), None
    return args.order, None, None


def measure_all(ctx: PatternContext, pats, points, order: str) -> list[tuple]:
    """[(pattern, point, record fields...)] for every pattern and point (collective). In rounds
    order every point is set up first and all are timed in one interleaved loop; in blocks
    order one point at a time."""
    comm, progress, clock = ctx.comm, ctx.progress, ctx.clock
    on_round = progress.iteration if ctx.rank == 0 else None
    groups = [[(p, pt)] for p in pats for pt in points] if order == "blocks" else \
        [[(p, pt) for p in pats for pt in points]]
    out = []
    for group in groups:
        label = "; ".join(f"{p.name} {pt.label}" for p, pt in group)
        progress.start(f"{ctx.transport.name} {ctx.args.granularity} {label}"
                       + (" (interleaved rounds)" if len(group) > 1 else ""))
        WATCHDOG.phase("set-up")
        runs = [p.setup(pt) for p, pt in group]
        try:
            local = measure(comm, ctx.settings, [h for r in runs for h in r.handoffs],
                            points=len(runs), on_round=on_round)
            WATCHDOG.phase("gathering samples")
            loops = critical_paths(comm, local, clock.offset_s)
            k = 0
            for (p, pt), run in zip(group, runs, strict=True):
                mine = loops[k:k + len(run.handoffs)] if loops else None
                k += len(run.handoffs)
                WATCHDOG.phase("data check")
                wrong = (ctx.engine.check(run.checked, ctx.args.debug_corrupt_elements)
                         if ctx.args.check and run.checked else None)
                WATCHDOG.phase("gathering records")
                out.append((p, pt, run.records(mine, wrong)))
                progress.finish("; ".join(f"{f.get('variant') or p.name} p50 "
                                          f"{f['loop'].samples.p50:.3f} ms" for f in out[-1][2]))
        finally:
            for run in runs:
                close_links(run.links)
    return out


def run(argv: Sequence[str] | None, comm) -> int:
    """The benchmark on every rank (collective); returns this rank's exit status."""
    rank, world = comm.Get_rank(), comm.Get_size()
    argv = list(sys.argv[1:] if argv is None else argv)
    WATCHDOG.phase("validation")
    args = build_parser(rank).parse_args(argv)
    WATCHDOG.timeout_s = args.timeout
    error = None
    try:
        model, dtype, device, tcls, pclasses, points = validate(args, world)
        if rank == 0 and not args.no_write:  # a bad --out costs a second, not a measurement
            check_destination(args.out)
    except UsageError as exc:
        error = exc
    error = agree(comm, error)
    if error:
        return usage_exit(rank, error)
    hosts = comm.allgather(os.uname().nodename)
    gpus = None
    if device == "cuda":  # one GPU per rank, by node-local rank; refuses two ranks on one GPU
        gpus, error = select_local_gpu(comm, args.allow_shared_gpu)
        if error:
            return usage_exit(rank, error)
    dev = make_device(device)
    try:
        return _run(args, argv, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points)
    finally:
        dev.close()


def usage_exit(rank: int, error: UsageError | str) -> int:
    if rank == 0:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return getattr(error, "exit_code", EXIT_USAGE)


def _run(args, argv, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points) -> int:
    rank = comm.Get_rank()
    WATCHDOG.phase("preparation")
    settings = LoopSettings(args.warmup, args.iters, args.min_iters, args.seconds_per_point)
    progress = Progress(enabled=rank == 0 and not args.quiet)
    tctx = TransportContext(comm, dev.name, args.timeout, args, hosts, dev)
    transport = tcls(tctx)
    engine = Engine(comm, transport, dev, args.timeout)
    ctx = PatternContext(comm, args, transport, model, dtype, dev.name, settings, progress,
                         args.timeout, engine)
    pats = [pc(ctx) for pc in pclasses]
    tctx.pairs = sorted({pair for p in pats for pair in p.pairs()})
    order, note, error = choose_order(comm, args, pats, points, hosts, dev.name)
    if not error:  # collective per-pattern set-up (calibration, plans); may refuse the run
        reasons = [p.prepare(points) for p in pats]
        error = agree(comm, next((r for r in reasons if r), None))
    if error:
        return usage_exit(rank, error)
    if note and rank == 0:
        print(f"{PROG}: {note}", file=sys.stderr)
    WATCHDOG.phase("connect")
    t_open = time.perf_counter()
    with WATCHDOG.bounded(f"opening the {tcls.name} transport"):
        transport.open()
    open_ms = (time.perf_counter() - t_open) * 1e3
    ctx.clock = estimate_clock(comm, hosts, args.clock, args.timeout)
    notice = notice_latency_ms(comm, 0, 1, args.timeout)
    envs = comm.gather(environment(), root=0)
    run_id = comm.bcast(f"{utc_stamp()}-{uuid.uuid4().hex[:8]}" if rank == 0 else None, root=0)
    spec_common, base_common = common_fields(args, argv, comm, hosts, gpus, dev, model, dtype,
                                             transport, points)
    base_common.update(transport_open_ms=open_ms, run_id=run_id, order=order,
                       clock=ctx.clock.as_dict())
    if args.debug_stall_rank == rank:  # injected fault: this rank stops answering
        time.sleep(3 * args.timeout + 30)
    progress.total = len(points) * len(pats) if order == "blocks" else 1
    measured = measure_all(ctx, pats, points, order)
    records = assemble(args, comm, dev.name, measured, spec_common, base_common, notice)
    WATCHDOG.phase("tear-down")
    info = transport.info()
    with WATCHDOG.bounded(f"closing the {transport.name} transport"):
        transport.close()
    if rank != 0:
        return 0
    return report(args, records, info, envs, notice)


def common_fields(args, argv, comm, hosts, gpus, dev, model, dtype, transport, points
                  ) -> tuple[dict, dict]:
    """(the spec entries every record of the run shares, the record fields they share)."""
    raw = points[0].raw_bytes is not None
    tcls = type(transport)
    spec_common = {
        "transport": tcls.name, "transport_options": transport.spec_options(),
        "layout": "raw" if raw else args.layout, "device": dev.name, "hosts": hosts,
        "block_size": args.block_size if args.layout == "paged" and not raw else None,
        "dtype": None if raw else dtype.name,
        "model": None if raw else model_key(model.name, model.geometry(),
                                            PRESETS[model.name].geometry()
                                            if model.name in PRESETS else None),
    }
    base_common = {
        "transport": tcls.name, "layout": spec_common["layout"], "dtype": spec_common["dtype"],
        "device": dev.name,
        "model": None if raw else {"name": model.name, **model.geometry()},
        "block_size": spec_common["block_size"],
        "world_size": comm.Get_size(), "hosts": hosts,
        "gpus": gpus,
        "argv": [sys.executable, "-m", "kvbench.p2p", *argv],
        **transport.record_fields(),
    }
    return spec_common, base_common


def assemble(args, comm, device: str, measured, spec_common: dict, base_common: dict,
             notice: float | None) -> list[dict]:
    """Records from the measured fields (rank 0; others get an empty list), with the
    yardstick of --baseline timed per point (collective)."""
    records = []
    for pat, pt, results in measured:
        yardstick = None
        if args.baseline:
            WATCHDOG.phase("baseline")
            yardstick = baseline_gbps(comm, results[0]["bytes"] if comm.Get_rank() == 0 else None,
                                      device, args)
        for fields in results:
            spec = make_spec(spec_common, pat, fields).as_dict()
            rec = make_record({**base_common, "pattern": pat.name}, pt, fields, notice)
            rec.update(spec=spec, spec_id=spec_id_of(spec))
            if yardstick:
                add_baseline(rec, yardstick)
            records.append(rec)
    return records


def add_baseline(rec: dict, yardstick: dict[str, float | None]) -> None:
    """Yardstick figures and kvbench's ratio to the last (most demanding) one."""
    for kind, gbps in yardstick.items():
        rec[f"baseline_{kind}_gbps"] = gbps
    kind, gbps = list(yardstick.items())[-1]
    rec["baseline_kind"] = kind
    rec["vs_baseline"] = rec["gbps"] / gbps if gbps and rec["gbps"] is not None else None
    ratio = "-" if rec["vs_baseline"] is None else f"{rec['vs_baseline']:.3f}"
    rec["table_note"] = (f"{LABELS[kind]} {_num(gbps, '.2f')} GB/s; "
                         f"kvbench/{kind.replace('_', ' ')} = {ratio}")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(args, records: list[dict], info: dict, envs: list[dict], notice: float) -> int:
    """Rank 0: finish the records, print the table, write the files, return the exit status."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for rec in records:
        rec["transport_info"] = info
        rec["env"] = {"ranks": envs, **{k: envs[0][k] for k in ("torch", "mpi4py", "mpi_library",
                                                                  "nccl", "nixl", "gpu", "cpu")}}
        rec["timestamp"] = stamp
    print(format_table(records))
    print(f"notice one-way latency {notice:.4f} ms (included once in every sample); "
          f"GB/s = bytes / p50 (decimal); n = samples; p95 needs n >= "
          f"{min_samples_for(95)}, p99 n >= {min_samples_for(99)}; order {records[0]['order']}")
    rss = [v for r in records for v in (r.get("peak_rss_bytes") or [])]
    if rss:
        largest = max(r["bytes"] for r in records)
        print(f"peak memory per rank {max(rss) / GiB:.2f} GiB = {max(rss) / largest:.2f}x the "
              f"largest payload ({largest / GiB:.2f} GiB)")
    if not args.no_write:
        try:  # the .jsonl and its .csv appear together or not at all
            jpath, cpath = write_records(Path(args.out), [{k: v for k, v in r.items()
                                                           if k != "table_note"} for r in records],
                                         "kvbench-p2p")
        except UsageError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"records: {jpath}  (csv: {cpath.name})")
    wrong = sum(r["wrong"] or 0 for r in records)
    if wrong:
        print(f"{PROG}: error: data check failed: {wrong} wrong elements received", file=sys.stderr)
        return 1
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m kvbench.p2p`: MPI started and ended here (unless the caller already runs
    it), every wait on a peer bounded by --timeout (kvbench.watchdog)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    timeout, stop_at = prescan(argv)
    WATCHDOG.start(PROG, timeout, stop_at)
    owned = mpi_world.init()
    comm = mpi_world.world()
    WATCHDOG.rank = comm.Get_rank()
    code = 1
    try:
        code = run(argv, comm)
    except SystemExit as exc:
        code = int(exc.code or 0)
    except TransportError as exc:
        abort_job(comm, str(exc), EXIT_STALLED)
    except UsageError as exc:  # found by one rank alone: the others may be waiting on it
        abort_job(comm, str(exc), exc.exit_code)
    except BaseException:  # a bug on one rank must not leave the others waiting forever
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    if owned:
        WATCHDOG.phase("tear-down")
        mpi_world.finalize()
    return code


def abort_job(comm, message: str, code: int) -> None:
    print(f"{PROG}: error: rank {comm.Get_rank()}: {WATCHDOG.current}: {message}; aborting the "
          "job", file=sys.stderr, flush=True)
    comm.Abort(code)


if __name__ == "__main__":
    sys.exit(cli())
