"""`kvbench p2p`: the job's run on every rank: MPI up under the watchdog, flags agreed, the
patterns measured on the one engine, records written, the table printed, MPI down."""

from __future__ import annotations

import os
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvbench.cli import (
    EXIT_USAGE,
    UsageError,
)
from kvbench.links import linkpath
from kvbench.model import PRESETS
from kvbench.p2p import world as mpi_world
from kvbench.p2p.args import PROG, build_parser, prescan, validate
from kvbench.p2p.baseline import LABELS, baseline_gbps, baseline_kinds
from kvbench.p2p.devices import make_device, mem_available_bytes
from kvbench.p2p.engine import Engine, close_links
from kvbench.p2p.gpu_select import select_local_gpu
from kvbench.p2p.harness import (
    LoopResult,
    LoopSettings,
    Progress,
    estimate_clock,
    measure,
    notice_latency_ms,
)
from kvbench.p2p.patterns.base import PatternContext, Point, reduce_runs
from kvbench.p2p.spec import HandoffSpec, model_key, spec_id_of
from kvbench.p2p.transports.base import PeerReported, Reported, TransportContext, TransportError
from kvbench.p2p.watchdog import EXIT_STALLED, WATCHDOG
from kvbench.records.schema.p2p import SCHEMA_P2P, P2PRecord
from kvbench.records.stats import min_samples_for, percentile_cell
from kvbench.records.write import (
    check_destination,
    contract_dump,
    environment,
    utc_stamp,
    write_records,
)
from kvbench.units import GB, GiB, MiB, gb_per_s


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
    """The record's frozen 'what was measured' (everything but the payload size). A record
    that names its pair (the matrix) has that pair's roles."""
    pair = fields.get("pair")
    prefill, decode = ([pair[0]], [pair[1]]) if pair else pattern.roles()
    if common["block_size"] is not None and "block_size" in fields:  # a block-size sweep
        common = {**common, "block_size": fields["block_size"]}
    return HandoffSpec(**common, pattern=pattern.name, variant=fields.get("variant"),
                       cut=fields.get("cut"),
                       granularity=fields["granularity"],
                       pack_kernel=pattern.ctx.args.pack_kernel if fields.get("packed") else None,
                       world={"size": len(common["hosts"]), "prefill_ranks": prefill,
                              "decode_ranks": decode},
                       **pattern.spec_fields())


def make_record(base: dict, point: Point, fields: dict, notice_ms: float | None) -> dict:
    """One `kvbench.p2p/1` line, built as its contract (P2PRecord, the class fit and
    results.load read it back into) and dumped from it."""
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
    return contract_dump(P2PRecord, rec, "the p2p record being written")


def cut_text(r: dict) -> str:
    """A record's cut for the table: block size, and for the page plan pages, ids and TP pair."""
    cut = r.get("cut") or {}
    bs = f"bs {r['block_size']}" if r.get("block_size") else ""
    tp = "" if cut.get("tp") in (None, "1:1") else f" tp {cut['tp']}"
    return (bs + (f" {cut['kv']} {cut['blocks']}" if cut else "") + tp).strip() or "-"


def format_table(records: list[dict]) -> str:
    w = max([11] + [len(r["pattern"]) + 1 + len(r["variant"]) for r in records if r.get("variant")])
    cuts = [cut_text(r) for r in records]
    show_cut = any(r.get("cut") for r in records) or len(set(cuts)) > 1
    wc = max(len(c) for c in cuts) if show_cut else 0
    head = (f"{'pattern':<{w}} {'transport':<9} {'gran':<6} " + (f"{'cut':<{wc}} " if show_cut else "")
            + f"{'tokens':>7} {'bytes':>14} {'MiB':>9} {'desc':>8} "
            f"{'n':>4} {'p50 ms':>9} {'p95 ms':>11} {'p99 ms':>12} {'GB/s':>7} {'cold ms':>9} "
            f"{'wrong':>6}")
    lines = [head, "-" * len(head)]
    for r, cut in zip(records, cuts, strict=True):
        tok = "-" if r["prompt_tokens"] is None else str(r["prompt_tokens"])
        wrong = "-" if r["wrong"] is None else str(r["wrong"])
        variant = r.get("variant")
        name = r["pattern"] + (f"/{variant}" if variant else "")
        n = r["n_samples"]
        # a bytes/time rate only where the record is a transfer (not compute, not summed edges)
        rate = f"{_num(r['gbps'] if r.get('fit_as_link', True) else None, '.2f'):>7}"
        lines.append(
            f"{name:<{w}} {r['transport']:<9} {r['granularity']:<6} "
            + (f"{cut:<{wc}} " if show_cut else "") + f"{tok:>7} {r['bytes']:>14,} "
            f"{r['bytes'] / MiB:>9.1f} {_num(r.get('descriptors'), ','):>8} {n:>4} {r['p50_ms']:>9.3f} "
            f"{percentile_cell(r['p95_ms'], 95, n):>11} {percentile_cell(r['p99_ms'], 99, n):>12} "
            f"{rate} {_num(r['cold_ms'], '.3f'):>9} {wrong:>6}")
        if r.get("table_note"):
            lines.append(f"    {r['table_note']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# main


def gpu_free_bytes() -> int | None:
    """Free memory of this rank's (bound) GPU, as the driver reports it."""
    import torch

    try:
        return int(torch.cuda.mem_get_info()[0])
    except (RuntimeError, AssertionError):
        return None


def memory_domains(device: str, hosts: list[str], gpus) -> tuple[list[str], int | None, str]:
    """(each rank's memory domain, this rank's free bytes there, what they are called). On
    CUDA the KV lives on the GPU: ranks sharing one GPU share its free memory."""
    if device == "cuda":
        gpus = gpus or [None] * len(hosts)
        keys = [f"{h} GPU {(g or {}).get('uuid') or (g or {}).get('index')}"
                for h, g in zip(hosts, gpus, strict=True)]
        return keys, gpu_free_bytes(), "free on the GPU"
    return list(hosts), mem_available_bytes(), "available"


def choose_order(comm, args, pats, points, hosts, device, gpus=None
                 ) -> tuple[str | None, str | None, str | None]:
    """(order, note, error). Rounds keep every size's data alive at once: when that does not fit
    but one size at a time does, measure in blocks and say so in one line; when even one size
    does not fit, refuse. Estimated per memory domain (a host's RAM; on CUDA a GPU), before
    allocating, against MemAvailable or the GPU's free memory (collective)."""
    rank = comm.Get_rank()
    alive = [p.bytes_per_rank(pt) for p in pats for pt in points]
    need = {"rounds": sum(alive), "blocks": max(alive)}
    where, free, what = memory_domains(device, hosts, gpus)
    if not all(comm.allgather(free is not None)):  # every rank skips together, or none does
        return args.order, None, None
    fits = {}
    for order, mine in need.items():
        per_domain: dict[str, int] = {}
        for d, n in zip(where, comm.allgather(mine), strict=True):
            per_domain[d] = per_domain.get(d, 0) + n
        fits[order] = per_domain[where[rank]] <= 0.9 * free
        need[order] = per_domain[where[rank]]
    fits = {k: all(comm.allgather(v)) for k, v in fits.items()}
    memory = "GPU memory" if device == "cuda" else "memory"
    if not fits["blocks"]:
        return None, None, (f"payload would not fit in {memory} on {where[rank]}: the ranks there "
                            f"need about {need['blocks'] / GB:.1f} GB, {free / GB:.1f} GB is "
                            f"{what}; use smaller --sizes or fewer ranks per "
                            f"{'GPU' if device == 'cuda' else 'host'}")
    if args.order == "rounds" and not fits["rounds"]:
        return "blocks", (f"note: every size at once needs about {need['rounds'] / GB:.1f} GB on "
                          f"{where[rank]}, {free / GB:.1f} GB is {what}: measuring one size at "
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
                            points=sum(r.points for r in runs), on_round=on_round)
            WATCHDOG.phase("gathering samples")
            loops = reduce_runs(comm, runs, local, clock.offset_s)
            for (p, pt), run, mine in zip(group, runs, loops, strict=True):
                WATCHDOG.phase("data check")
                wrong = check_run(ctx, run.checked) if ctx.args.check and run.checked else None
                WATCHDOG.phase("gathering records")
                out.append((p, pt, run.records(mine, wrong)))
                progress.finish("; ".join(f"{f.get('variant') or p.name} p50 "
                                          f"{f['loop'].samples.p50:.3f} ms" for f in out[-1][2]))
        finally:
            for run in runs:
                close_links(run.links)
    return out


def check_run(ctx: PatternContext, checked):
    """This rank's wrong elements of the checked handoff (a list: of each checked handoff)."""
    if isinstance(checked, list):
        return [ctx.engine.check(h, ctx.args.debug_corrupt_elements) for h in checked]
    return ctx.engine.check(checked, ctx.args.debug_corrupt_elements)


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


def usage_exit(rank: int, error: UsageError | str) -> int:
    if rank == 0:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return getattr(error, "exit_code", EXIT_USAGE)


def _run(args, argv, comm, hosts, gpus, dev, model, dtype, tcls, pclasses, points,
         written=None) -> int:
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
    records = assemble(args, comm, dev.name, measured, spec_common, base_common, notice,
                       transport)
    WATCHDOG.phase("tear-down")
    info = transport.info()
    pairs = sorted({pair for p in pats if p.per_pair for pair in p.pairs()})
    by_pair = transport.info_by_pair(info, pairs) if pairs else {}  # (collective)
    with WATCHDOG.bounded(f"closing the {transport.name} transport"):
        transport.close()
    if rank != 0:
        return 0
    for rec in records:  # a record that names its pair gets that pair's path
        if rec.get("pair"):
            rec["transport_info"] = by_pair.get(tuple(rec["pair"]), info)
    return report(args, records, info, envs, notice, written)


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
             notice: float | None, transport=None) -> list[dict]:
    """Records from the measured fields (rank 0; others get an empty list), with the
    yardstick of --baseline timed per point (collective), the transport's own last."""
    records = []
    for pat, pt, results in measured:
        yardstick, detail = None, {}
        if args.baseline:
            WATCHDOG.phase("baseline")
            kinds, note = baseline_kinds(device, base_common.get("gpus"))
            yardstick = baseline_gbps(comm, results[0]["bytes"] if comm.Get_rank() == 0 else None,
                                      kinds, args, base_common.get("gpus"))
            yardstick, detail = yardstick if yardstick is not None else (None, {})
            own = transport.yardsticks(results[0] if comm.Get_rank() == 0 else None) \
                if transport is not None else {}
            if comm.Get_rank() == 0:
                yardstick = {**yardstick, **own}
        for fields in results:
            spec = make_spec(spec_common, pat, fields).as_dict()
            rec = make_record({**base_common, "pattern": pat.name}, pt, fields, notice)
            rec.update(spec=spec, spec_id=spec_id_of(spec))
            if args.baseline and comm.Get_rank() == 0:
                add_baseline(rec, yardstick, note, detail)
            records.append(rec)
    return records


def add_baseline(rec: dict, yardstick: dict[str, float | None], note: str | None = None,
                 detail: dict | None = None) -> None:
    """Yardstick figures, kvbench's ratio to each (`vs_<kind>`) and to the last one listed
    (`vs_baseline`, `baseline_kind`), and a table line naming them all (or why there is none).
    `detail` (baseline_gbps): the host copy's method and every candidate's GB/s, each with
    kvbench's ratio to it in the line."""
    detail = detail or {}
    cells = []
    for kind, gbps in yardstick.items():
        ratio = _ratio(rec["gbps"], gbps)
        rec[f"baseline_{kind}_gbps"] = gbps
        rec[f"vs_{kind}"] = ratio
        label = LABELS.get(kind, kind)
        if kind == "host_copy" and detail.get("host_copy_method"):
            label = f"{label} ({detail['host_copy_method']}, the fastest)"
        cells.append(f"{label} {_num(gbps, '.2f')} GB/s, kvbench/{kind.replace('_', ' ')} = "
                     f"{_num(ratio, '.3f')}")
        if kind == "host_copy" and detail.get("host_copy_by_method_gbps"):
            cells[-1] += _by_method(rec, detail)
    if yardstick:
        kind = list(yardstick)[-1]
        rec["baseline_kind"], rec["vs_baseline"] = kind, rec[f"vs_{kind}"]
    if note:
        rec["baseline_note"] = note
        cells.append(note)
    line = "; ".join(cells)
    rec["table_note"] = f"{rec['table_note']}\n    {line}" if rec.get("table_note") else line


def _ratio(gbps: float | None, floor: float | None) -> float | None:
    return gbps / floor if floor and gbps is not None else None


def _by_method(rec: dict, detail: dict) -> str:
    """Record every host-copy candidate and kvbench's ratio to it; the line's bracket."""
    by = detail["host_copy_by_method_gbps"]
    rec["baseline_host_copy_method"] = detail["host_copy_method"]
    rec["baseline_host_copy_by_method_gbps"] = dict(by)
    rec["vs_host_copy_by_method"] = {m: _ratio(rec["gbps"], g) for m, g in by.items()}
    return " [" + ", ".join(f"{m} {_num(g, '.2f')} GB/s, kvbench/{m} = "
                            f"{_num(rec['vs_host_copy_by_method'][m], '.3f')}"
                            for m, g in by.items()) + "]"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def peak_memory_line(records: list[dict]) -> str | None:
    """Peak memory per rank against the largest payload: host RSS, and on CUDA the device's
    peak (where the KV lives; RSS there is the staging and the interpreter)."""
    largest = max((r["bytes"] for r in records), default=0)
    parts = []
    for key, what in (("peak_device_bytes", "GPU (torch peak allocated)"),
                      ("peak_rss_bytes", "host RSS")):
        vals = [v for r in records for v in (r.get(key) or []) if v is not None]
        if vals and largest:
            parts.append(f"{what} {max(vals) / GiB:.2f} GiB = {max(vals) / largest:.2f}x")
    if not parts:
        return None
    return f"peak memory per rank: {'; '.join(parts)} the largest payload ({largest / GiB:.2f} GiB)"


def emulation_line(records: list[dict]) -> str | None:
    """One line when a record's KV went over UCX's software emulation, with its causes and
    fixes (kvbench.links.linkcauses); None otherwise."""
    return linkpath.emulation_note(linkpath.classify_record(r) for r in records)


def report(args, records: list[dict], info: dict, envs: list[dict], notice: float,
           written: dict | None = None) -> int:
    """Rank 0: finish the records, print the table, write the files, return the exit status."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary = {k: envs[0][k] for k in ("torch", "mpi4py", "mpi_library", "nccl", "nixl", "gpu",
                                       "cpu")}
    for k, rec in enumerate(records):
        rec.setdefault("transport_info", info)
        # every rank's environment once per job: a matrix's N(N-1) pair records would
        # otherwise carry N of them each (N^3 in the file); its later records carry rank 0's
        once = k > 0 and rec.get("pair") is not None
        rec["env"] = ({"ranks": envs[:1], "ranks_in": "the first record", **summary} if once
                      else {"ranks": envs, **summary})
        if once and isinstance(rec.get("clock"), dict):  # its pair's two offsets, not N
            clock, (s, d) = rec["clock"], rec["pair"]
            rec["clock"] = {"method": clock.get("method"), "ranks_in": "the first record",
                            "pair_offset_ms": [clock["offset_ms"][s], clock["offset_ms"][d]]}
        rec["timestamp"] = stamp
    print(format_table(records))
    print(f"notice one-way latency {notice:.4f} ms (included once in every sample); "
          f"GB/s = bytes / p50 (decimal); n = samples; p95 needs n >= "
          f"{min_samples_for(95)}, p99 n >= {min_samples_for(99)}; order {records[0]['order']}")
    line = peak_memory_line(records)
    if line:
        print(line)
    line = emulation_line(records)
    if line:  # once per run, with or without --expect-link: the figures are not the link's
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    if not args.no_write:
        try:  # the .jsonl and its .csv appear together or not at all
            jpath, cpath = write_records(Path(args.out), [{k: v for k, v in r.items()
                                                           if k != "table_note"} for r in records],
                                         "kvbench-p2p")
        except UsageError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"records: {jpath}  (csv: {cpath.name})")
        if written is not None:
            written["records"] = jpath
    wrong = sum(r["wrong"] or 0 for r in records)
    if wrong:
        print(f"{PROG}: error: data check failed: {wrong} wrong elements received", file=sys.stderr)
        return 1
    return 0


def cli(argv: Sequence[str] | None = None, written: dict | None = None) -> int:
    """`python -m kvbench.p2p`: MPI started and ended here (unless the caller already runs
    it), every wait on a peer bounded by --timeout (kvbench.p2p.watchdog). `written`: see run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    timeout, stop_at = prescan(argv)
    WATCHDOG.start(PROG, timeout, stop_at)
    owned = mpi_world.init()
    comm = mpi_world.world()
    WATCHDOG.rank = comm.Get_rank()
    code = 1
    try:
        code = run(argv, comm, written)
    except SystemExit as exc:
        code = int(exc.code or 0)
    except PeerReported:
        code = await_the_end(comm)
    except Reported as exc:
        code = report_and_end(comm, exc)
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


def await_the_end(comm) -> int:
    """A peer reports this failure in its own line: wait for the end without a second line.
    The peer either joins this barrier (the failure is known to every rank: both then exit
    normally, after the launcher has forwarded its line) or aborts the job; should neither
    come, the watchdog ends this rank after --timeout."""
    with WATCHDOG.bounded("the job's end after a peer's error"):
        comm.Barrier()
    return EXIT_STALLED


def report_and_end(comm, exc: Reported) -> int:
    """This rank's failure, known to its peer: one line, then a barrier with every rank when
    every rank knows (the pair is the job, or the error was agreed over MPI), else the abort.
    A normal exit lets the launcher forward the line; MPI_Abort may end the job first."""
    if not (exc.everyone or comm.Get_size() == 2):
        abort_job(comm, str(exc), EXIT_STALLED)
    print(f"{PROG}: error: rank {comm.Get_rank()}: {WATCHDOG.current}: {exc}; ending the job",
          file=sys.stderr, flush=True)
    with WATCHDOG.bounded("the job's end after this rank's error"):
        comm.Barrier()
    return EXIT_STALLED


def abort_job(comm, message: str, code: int) -> None:
    print(f"{PROG}: error: rank {comm.Get_rank()}: {WATCHDOG.current}: {message}; aborting the "
          "job", file=sys.stderr, flush=True)
    comm.Abort(code)


if __name__ == "__main__":
    sys.exit(cli())
