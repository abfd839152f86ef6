"""Layerwise handoff (Splitwise style): the prefill rank sends each layer's KV as soon as that
layer is computed, while it computes the next ones, so most of the transfer hides behind
compute. Rank 0 prefills, rank 1 decodes.

One point declares four handoffs on the engine, timed in the same interleaved rounds (see
`harness.measure`), and reports each as a variant:

    layerwise/compute  the sender's compute for every layer, nothing sent   -> T_compute
    layerwise/xfer     the same per-layer messages, all posted at once, no compute -> T_x
    layerwise/seq      a sequential handoff at --granularity (default: one whole message)
    layerwise          compute layer l, post layer l's sends (non-blocking), compute l+1 ...;
                       done when every send completed and decode's notice arrived
                       (the engine's per-layer hook: the compute, polling sends in flight)

    exposed_ms       = median over rounds of (layerwise_i - compute_i)  (same-round pairs)
    exposed_ideal_ms = max(0, (T_x - T_compute) (L-1)/L) + T_x/L       (pipeline bound)
    overlap_efficiency = (T_x - exposed) / (T_x - exposed_ideal)        (1 = ideal, 0 = none)
    saves_ms         = p50(seq) - exposed_ms  (> 0: layerwise pays against compute-then-send)

On an asynchronous device (CUDA; cpu-async in tests) the overlapped handoff never has the host
wait on a layer's compute: the hook only queues layer l's kernels, the engine records the
step's readiness event and posts layer l's messages at once, then the hook queues layer l+1.
Each transport orders its bytes after the event on the device: NCCL enqueues behind the
compute stream, ipc records its IPC event there, and a host-staged MPI send has its
device-to-host copy queued on the device's copy stream (Device.copy_after: a second stream
that waits on the event, so layer l's copy runs while layer l+1 computes) and is handed to MPI
once the copy's event is done, polled, never waited on; Gloo's staged sends go the same way,
and MPI device-direct and NIXL hand over a layer (NIXL: issue its transfer or, reading,
announce it) once the layer's event is done, polled as well (transports.base.HeldPosts).
The compute-only run waits once, on the last layer.
"""

from __future__ import annotations

import sys

import torch

from kvbench.cli import arg_float, arg_int
from kvbench.p2p import compute
from kvbench.p2p.engine import Handoff
from kvbench.p2p.layout import KVCache, KVSpec
from kvbench.p2p.messages import plan_messages
from kvbench.p2p.patterns import register
from kvbench.p2p.patterns.base import (
    NOT_LINK_COMPUTE,
    Measured,
    Pattern,
    Point,
    PointRun,
    descriptors_of,
    make_data,
    posted_counts,
)
from kvbench.p2p.patterns.sequential import estimate_bytes, pair_records
from kvbench.records.stats import percentile

VARIANTS = ("compute", "xfer", "seq", None)  # None: the overlapped handoff itself


def layer_granularity(granularity: str) -> str:
    """Layerwise needs messages that belong to one layer: 'whole' becomes 'layer'."""
    return "layer" if granularity == "whole" else granularity


def exposed_ideal_ms(transfer_ms: float, compute_ms: float, layers: int) -> float:
    """Least transfer time left exposed when layer l's KV (T_x/L) can only leave after layer l's
    compute (T_compute/L) and the link carries one layer at a time:
    max(0, (T_x - T_compute)(L-1)/L) + T_x/L. Equals T_x without compute, T_x/L once
    compute per layer covers transfer per layer."""
    L = max(1, layers)
    return max(0.0, (transfer_ms - compute_ms) * (L - 1) / L) + transfer_ms / L


def overlap_efficiency(transfer_ms: float, exposed_ms: float, ideal_ms: float) -> float | None:
    """Share of the hideable transfer actually hidden: (T_x - exposed) / (T_x - ideal)."""
    room = transfer_ms - ideal_ms
    return None if room <= 0 else (transfer_ms - exposed_ms) / room


class WithThreads:
    """A handoff run with --compute-threads torch threads on this rank (restored after it,
    outside the timed window), so sender compute, receiver and transport progress share the
    cores as configured, whatever else the run measures in between."""

    def __init__(self, handoff, threads: int):
        self.handoff, self.threads = handoff, threads

    def __call__(self):
        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.handoff()
        finally:
            torch.set_num_threads(prev)


@register
class Layerwise(Pattern):
    name = "layerwise"
    description = "each layer's KV sent (non-blocking) as soon as it is computed, rank 0 -> 1"

    @classmethod
    def add_arguments(cls, parser) -> None:
        g = parser.add_argument_group("layerwise pattern")
        g.add_argument("--layer-compute", choices=("ms", "model"), default="ms",
                       help="sender compute per layer: calibrated GEMM tiles for "
                            "--layer-compute-ms (default), or the model's prefill-layer GEMMs "
                            "at the prompt length")
        g.add_argument("--layer-compute-ms", type=arg_float(0, 1e4, lo_open=True), default=None,
                       metavar="X",
                       help="real GEMM work per layer, calibrated to about X ms here (default 1)")
        g.add_argument("--compute-threads", type=arg_int(1, 4096), default=1, metavar="N",
                       help="torch threads per rank during layerwise runs (default 1: sender "
                            "compute, receiver and transport progress share the cores)")
        g.add_argument("--layer-poll", action="store_true", default=True,
                       help="test posted sends between compute chunks (default)")
        g.add_argument("--no-layer-poll", dest="layer_poll", action="store_false",
                       help="never test sends while computing (progress only from the transport)")

    @classmethod
    def layout_error(cls, args, world_size, model) -> str | None:
        err = super().layout_error(args, world_size, model)
        if err:
            return err
        if args.bytes or args.minbytes or args.maxbytes:
            return "pattern layerwise moves a model's KV layer by layer: give --sizes in tokens, not --bytes"
        if args.compute_threads < 1:
            return f"--compute-threads must be at least 1, got {args.compute_threads}"
        if args.layer_compute == "model":
            if args.layer_compute_ms is not None:
                return "give either --layer-compute model or --layer-compute-ms, not both"
            return compute.model_error(model)
        if args.layer_compute_ms is not None and not args.layer_compute_ms > 0:
            return f"--layer-compute-ms must be positive, got {args.layer_compute_ms}"
        return None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cal: compute.Calibration | None = None
        self.work: dict[int, compute.LayerWork] = {}  # per prompt length (model mode) or {0: ..}
        self.work_info: dict[int, dict] = {}
        self.weights: compute.ModelWeights | None = None

    @property
    def layer_ms(self) -> float:
        return self.ctx.args.layer_compute_ms or 1.0

    def _threads(self):
        prev = torch.get_num_threads()
        torch.set_num_threads(self.ctx.args.compute_threads)
        return prev

    def prepare(self, points: list[Point]) -> str | None:
        """Calibrate on the sender, build each point's layer work, check it fits the timeout."""
        ctx, args = self.ctx, self.ctx.args
        prev = self._threads()
        try:
            reason = None
            if ctx.rank == 0:
                self.cal = compute.calibrate(ctx.dev.torch_device, args.compute_threads)
                for pt in points:
                    key = pt.prompt_tokens if args.layer_compute == "model" else 0
                    if key in self.work:
                        continue
                    # refuse before allocating or timing anything: a 70B layer at thousands of
                    # tokens is seconds of CPU arithmetic
                    predicted = (self.layer_ms if args.layer_compute == "ms" else
                                 compute.layer_flops(ctx.model, pt.prompt_tokens)
                                 / (self.cal.gflops * 1e6))
                    reason = self._too_slow(pt, predicted, "predicted")
                    if reason:
                        break
                    if args.layer_compute == "model":
                        self.weights = self.weights or compute.ModelWeights(ctx.model, ctx.dev.torch_device)
                        work = compute.model_work(ctx.model, pt.prompt_tokens, self.cal,
                                                  self.weights)
                    else:
                        work = compute.tile_work(self.cal, self.layer_ms)
                    work.description["measured_layer_ms"] = work.time_ms(3 if predicted < 200 else 1)
                    self.work[key], self.work_info[key] = work, work.description
                    reason = self._too_slow(pt, work.description["measured_layer_ms"], "measured")
                    if reason:
                        break
                self._announce()
            return ctx.comm.bcast(reason, root=0)
        finally:
            torch.set_num_threads(prev)

    def _too_slow(self, pt: Point, layer_ms: float, how: str) -> str | None:
        ctx = self.ctx
        per_handoff_s = layer_ms * ctx.model.layers / 1e3
        if per_handoff_s <= ctx.timeout_s / 2:
            return None
        return (f"layerwise: the sender's compute would take about {per_handoff_s:.1f} s per "
                f"handoff at {pt.label} ({ctx.model.layers} layers x {layer_ms:.1f} ms {how} on "
                f"{ctx.device}), over half the --timeout {ctx.timeout_s:g} s: use a smaller "
                "--layer-compute-ms, fewer tokens or layers, or a larger --timeout")

    def _announce(self) -> None:
        if self.ctx.args.quiet:
            return
        c = self.cal
        print(f"layerwise: {c.threads} torch thread(s) per rank; GEMM tile {c.tile_n}x{c.tile_n} "
              f"{c.dtype} {c.tile_ms:.3f} ms ({c.gflops:.1f} GFLOP/s)", file=sys.stderr)
        for key, d in self.work_info.items():
            what = (f"{d['tiles_per_layer']} tiles, target {d['target_layer_ms']:g} ms"
                    if d["mode"] == "ms" else
                    f"{key} tok: {d['layer_flops'] / 1e9:.2f} GFLOP in {d['chunks_per_layer']} chunks, "
                    f"predicted {d['predicted_layer_ms']:.1f} ms")
            print(f"layerwise: compute per layer {what}, measured {d['measured_layer_ms']:.2f} ms",
                  file=sys.stderr)

    def bytes_per_rank(self, point: Point) -> int:
        ctx = self.ctx
        gran = layer_granularity(ctx.args.granularity)
        need = estimate_bytes(ctx, point, gran)
        if ctx.args.layout == "paged" and ctx.args.granularity not in ("block", gran):
            need += KVSpec(ctx.model, ctx.dtype, point.prompt_tokens, [], "paged",
                           ctx.args.block_size).payload_bytes  # the seq plan's own staging
        if ctx.rank == 0 and ctx.args.layer_compute == "model" and point.prompt_tokens:
            need += compute.model_work_bytes(ctx.model, point.prompt_tokens, ctx.device)
        return need

    def spec_fields(self) -> dict:
        a = self.ctx.args
        return {"compute": {"layer_compute": a.layer_compute,
                            "layer_compute_ms": self.layer_ms if a.layer_compute == "ms" else None,
                            "compute_threads": a.compute_threads},
                "layer_poll": a.layer_poll}

    def setup(self, point: Point) -> PointRun:
        """Four handoffs over one KV: compute only, per-layer messages at once (xfer), a
        sequential handoff at --granularity (seq), and compute with per-layer posts."""
        ctx, eng, args = self.ctx, self.ctx.engine, self.ctx.args
        is_sender, L = ctx.rank == 0, ctx.model.layers
        key = point.prompt_tokens if args.layer_compute == "model" else 0
        work = self.work.get(key) if is_sender else None
        data = make_data(ctx, point, table_seed=ctx.rank)
        gran = layer_granularity(args.granularity)
        plan = plan_messages(data, gran)
        seq_plan = plan if args.granularity == gran else plan_messages(data, args.granularity)
        link = eng.link(0, 1, data, plan)
        seq_link = link if seq_plan is plan else eng.link(0, 1, data, seq_plan)
        eng.settle()
        poll = args.layer_poll

        def hook(_layer, poll_sends):  # queue the layer; never wait on it (see module docstring)
            work.run(poll_sends if poll else None, ctx.dev, wait=False)

        def compute_only(layer, poll_sends):  # done when the last layer's compute is
            work.run(poll_sends if poll else None, ctx.dev, wait=layer == L - 1)

        overlapped = Handoff(eng, [link], layers=L, hook=hook if is_sender else None,
                             name="overlapped")
        handoffs = [WithThreads(h, args.compute_threads) for h in (
            Handoff(eng, [], layers=L, hook=compute_only if is_sender else None, name="compute"),
            Handoff(eng, [link], name="xfer"),
            Handoff(eng, [seq_link], name="seq"),
            overlapped)]

        def records(loops, wrong) -> list[Measured]:
            counts = posted_counts(ctx, [link, seq_link])
            rec = pair_records(ctx, [link, seq_link], {}, loops, wrong)
            if not rec:
                return []
            rec["descriptors_by_plan"] = [descriptors_of(c)["descriptors"] for c in counts]
            return self._records(point, data, plan, seq_plan, loops, rec)

        return PointRun(point, handoffs, overlapped, [link, seq_link], records)

    def _records(self, point, data, plan, seq_plan, loops, shared: dict) -> list[Measured]:
        """The four variants' records (rank 0); the overlapped one carries the overlap's
        figures and the table's line about them (overlap_fields)."""
        ctx, args = self.ctx, self.ctx.args
        key = point.prompt_tokens if args.layer_compute == "model" else 0
        gran = layer_granularity(args.granularity)
        info = self.work_info.get(key, {})
        common = {
            "layers": ctx.model.layers,
            "stored_tokens": data.spec.tensor_tokens(0) if isinstance(data, KVCache) else None,
            "layer_compute": args.layer_compute,
            "compute_threads": args.compute_threads,
            "layer_poll": args.layer_poll,
            "calibration": {**self.cal.as_dict(), **info} if self.cal else None,
            "peak_rss_bytes": shared["peak_rss_bytes"],
            "peak_device_bytes": shared["peak_device_bytes"],
        }
        out = []
        for variant, lp in zip(VARIANTS, loops, strict=True):
            p = seq_plan if variant == "seq" else plan
            link = variant in ("xfer", "seq")
            granularity = args.granularity if variant == "seq" else gran
            out.append(Measured(lp, {
                **({"variant": variant} if variant else {}),
                "granularity": granularity,
                "bytes": 0 if variant == "compute" else p.nbytes,
                "descriptors": (0 if variant == "compute" else
                                shared["descriptors_by_plan"][1 if variant == "seq" else 0]),
                "packed": p.packed,
                **common,
                "fit_as_link": link,
                "not_link_reason": None if link else NOT_LINK_COMPUTE,
                "wrong": shared["wrong"] if variant is None else None,
                "breakdown_ms": shared["breakdown_ms"] if variant is None else {},
            }, self.entries(granularity, variant=variant, packed=p.packed)))
        overlap, out[-1].note = overlap_fields(loops, ctx.model.layers, plan.n, args.granularity)
        out[-1].fields.update(overlap)
        return out


def overlap_fields(loops, layers: int, msgs: int, granularity: str) -> tuple[dict, str]:
    """(the overlapped record's own figures, the table's line about them) from the four
    variants' loops (compute, xfer, seq, overlapped: VARIANTS' order)."""
    L = layers
    comp, xfer, seq, total = (lp.samples.p50 for lp in loops)
    # exposed: each round's overlapped handoff minus the same round's compute-only run
    # (same load, minutes apart at most), median over rounds; the difference of the two
    # p50s is kept too, but it subtracts two large noisy numbers
    per_round = [t - c for t, c in zip(loops[3].samples.samples_ms,
                                       loops[0].samples.samples_ms, strict=True)]
    exposed = percentile(per_round, 50)
    p50_diff = total - comp
    ideal = exposed_ideal_ms(xfer, comp, L)
    eff = overlap_efficiency(xfer, exposed, ideal)
    saves = seq - exposed
    note = (f"compute {comp:.2f} ms, T_x {xfer:.2f} ms ({msgs} msgs), exposed {exposed:.2f} ms "
            f"(ideal {ideal:.2f}; p50 difference {p50_diff:.2f}), overlap efficiency "
            f"{'-' if eff is None else f'{eff:.2f}'}; vs compute-then-send "
            f"({granularity}, {seq:.2f} ms): "
            + (f"saves {saves:.2f} ms" if saves > 0 else f"costs {-saves:.2f} ms more"))
    return {
        "compute_ms": comp,
        "transfer_ms": xfer,
        "sequential_ms": seq,
        "total_ms": total,
        "exposed_ms": exposed,
        "exposed_samples_ms": per_round,
        "exposed_p50_diff_ms": p50_diff,
        "exposed_ideal_ms": ideal,
        # The form, recorded as stated so a reader can compare: it equals the
        # pipeline bound when compute-bound and exceeds it by T_x/L when transfer-bound.
        "exposed_ideal_issue_formula_ms": max(0.0, xfer - comp * (L - 1) / L) + xfer / L,
        "overlap_efficiency": eff,
        "hidden_fraction": None if xfer <= 0 else 1 - exposed / xfer,
        "saves_ms": saves,
        "pays": saves > 0,
    }, note
