"""Orchestration of one `kvbench p2p` run on every rank (collective): flags validated and
agreed, devices and the transport up, memory planned, the patterns measured on the one
engine, records assembled, the transport down, and rank 0's report."""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Sequence

from kvbench.cli import UsageError
from kvbench.p2p.agree import agree, usage_exit
from kvbench.p2p.args import PROG, build_parser, validate
from kvbench.p2p.assemble import assemble, common_fields
from kvbench.p2p.devices import make_device
from kvbench.p2p.engine import Engine, close_links
from kvbench.p2p.gpu_select import select_local_gpu
from kvbench.p2p.harness import (
    LoopSettings,
    Progress,
    estimate_clock,
    measure,
    notice_latency_ms,
)
from kvbench.p2p.memory import choose_order
from kvbench.p2p.patterns.base import PatternContext, reduce_runs
from kvbench.p2p.report import report
from kvbench.p2p.transports.base import TransportContext
from kvbench.p2p.watchdog import WATCHDOG
from kvbench.records.write import check_destination, environment, utc_stamp


def run(argv: Sequence[str] | None, comm, written: dict | None = None) -> int:
    """The benchmark on every rank (collective); returns this rank's exit status. `written`
    (rank 0): gets the records file's path under "records" once it is written."""
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
        return _run(args, argv, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points,
                    written)
    finally:
        dev.close()


def _run(args, argv, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points,
         written=None) -> int:
    rank = comm.Get_rank()
    ctx, pats, order, error = prepare(args, comm, hosts, gpus, dev, model, dtype, tcls,
                                      pclasses, points)
    if error:
        return usage_exit(rank, error)
    transport = ctx.transport
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
    ctx.progress.total = len(points) * len(pats) if order == "blocks" else 1
    measured = measure_all(ctx, pats, points, order)
    records, notes = assemble(args, comm, dev.name, measured, spec_common, base_common, notice,
                              transport)
    return tear_down(args, comm, transport, pats, records, notes, envs, notice, written)


def prepare(args, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points):
    """(the patterns' context, the patterns, the order, an agreed error or None): the
    transport and engine built, memory planned, each pattern's collective set-up done."""
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
    order, note, error = choose_order(comm, args, pats, points, hosts, dev.name, gpus)
    error = error or transport.refusal()  # the same on every rank (hosts, pairs)
    if not error:  # collective per-pattern set-up (calibration, plans); may refuse the run
        reasons = [p.prepare(points) for p in pats]
        error = agree(comm, next((r for r in reasons if r), None))
    if note and rank == 0 and not error:
        print(f"{PROG}: {note}", file=sys.stderr)
    return ctx, pats, order, error


def tear_down(args, comm, transport, pats, records: list[dict], notes: list, envs, notice,
              written) -> int:
    """The transport's path (per pair where records name one) read and the transport closed
    (collective); rank 0 reports and returns the run's status, the others 0."""
    WATCHDOG.phase("tear-down")
    info = transport.info()
    pairs = sorted({pair for p in pats if p.per_pair for pair in p.pairs()})
    by_pair = transport.info_by_pair(info, pairs) if pairs else {}  # (collective)
    with WATCHDOG.bounded(f"closing the {transport.name} transport"):
        transport.close()
    if comm.Get_rank() != 0:
        return 0
    for rec in records:  # a record that names its pair gets that pair's path
        if rec.get("pair"):
            rec["transport_info"] = by_pair.get(tuple(rec["pair"]), info)
    return report(args, records, info, envs, notice, written, notes)


def measure_all(ctx: PatternContext, pats, points, order: str) -> list[tuple]:
    """[(pattern, point, [Measured, ...])] for every pattern and point (collective). In rounds
    order every point is set up first and all are timed in one interleaved loop; in blocks
    order one point at a time."""
    groups = [[(p, pt)] for p in pats for pt in points] if order == "blocks" else \
        [[(p, pt) for p in pats for pt in points]]
    out = []
    for group in groups:
        label = "; ".join(f"{p.name} {pt.label}" for p, pt in group)
        ctx.progress.start(f"{ctx.transport.name} {ctx.args.granularity} {label}"
                           + (" (interleaved rounds)" if len(group) > 1 else ""))
        out += measure_group(ctx, group)
    return out


def measure_group(ctx: PatternContext, group: list[tuple]) -> list[tuple]:
    """One group of (pattern, point) set up, timed in one interleaved loop, checked, and
    turned into what was measured; its links closed whatever happens (collective)."""
    comm, progress, clock = ctx.comm, ctx.progress, ctx.clock
    on_round = progress.iteration if ctx.rank == 0 else None
    WATCHDOG.phase("set-up")
    runs = [p.setup(pt) for p, pt in group]
    out = []
    try:
        local = measure(comm, ctx.settings, [h for r in runs for h in r.handoffs],
                        points=sum(r.points for r in runs), on_round=on_round)
        WATCHDOG.phase("gathering samples")
        loops = reduce_runs(comm, runs, local, clock.offset_s)
        for (p, pt), run, mine in zip(group, runs, loops, strict=True):
            WATCHDOG.phase("data check")
            wrong = check_run(ctx, run.checked) if ctx.args.check and run.checked else None
            WATCHDOG.phase("gathering records")
            out.append((p, pt, run.records(mine, wrong)))
            progress.finish("; ".join(f"{m.spec.variant or p.name} p50 "
                                      f"{m.loop.samples.p50:.3f} ms" for m in out[-1][2]))
    finally:
        for run in runs:
            close_links(run.links)
    return out


def check_run(ctx: PatternContext, checked):
    """This rank's wrong elements of the checked handoff (a list: of each checked handoff)."""
    if isinstance(checked, list):
        return [ctx.engine.check(h, ctx.args.debug_corrupt_elements) for h in checked]
    return ctx.engine.check(checked, ctx.args.debug_corrupt_elements)
