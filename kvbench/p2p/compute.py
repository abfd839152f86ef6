"""Real compute for the layerwise pattern: work that stands in for one prefill layer.

Two ways to size it:

    --layer-compute-ms X   a square GEMM tile, repeated so one layer takes about X ms on
                           this device; the tile time is calibrated at start-up
    --layer-compute model  the GEMMs of one prefill layer of the model at the prompt length:
                           QKV projection, output projection, gate+up and down projections
                           (the attention core, T^2 work, is left out: a conservative
                           stand-in, real prefill has more compute to hide transfer behind)

The work is a list of chunks (one tile, or a block of token rows of one GEMM). Between
chunks the caller's `poll` runs: the layerwise sender tests its outstanding send requests
there, the way an engine's progress thread drives a transport that only moves data when
polled. On CUDA (and cpu-async) the chunks are queued asynchronously; `run(wait=True)` has the
host poll until an event recorded after the layer's last chunk completes, `run(wait=False)`
(the overlapped layerwise handoff) only queues them: the layer's send is then queued behind
them on the device (a readiness event, the copy stream), and the host goes on to the next
layer without waiting on this one's compute.

No sleeps anywhere: every millisecond here is arithmetic on real tensors.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvbench.model import ModelSpec

TILE_TARGET_MS = 0.25  # calibrated tile: long enough for an efficient GEMM, short for polling
CHUNK_TARGET_MS = 1.0  # model mode: rows per GEMM chunk sized to about this long
MAX_TILE = 8192


def compute_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (bf16 GEMMs are slow on most CPUs), bf16 on GPU (what prefill runs in)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn: Callable[[], None], device: str, reps: int, stat=statistics.median) -> float:
    """`stat` (default: the median) of fn's wall time over reps, device-synchronised.
    Sizing passes `min`: load from other processes only ever adds time, and work sized
    on a busy moment would come out too small once the machine is quiet again."""
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return float(stat(out))


@dataclass
class Calibration:
    """What one GEMM tile costs on this device, with these threads."""

    device: str
    dtype: str
    threads: int
    tile_n: int  # square tile edge: [n, n] @ [n, n]
    tile_ms: float  # fastest of the timed tiles (see _time_ms)
    gflops: float  # 2 n^3 / tile time (decimal GFLOP/s)

    def as_dict(self) -> dict:
        return asdict(self)


def calibrate(device: str, threads: int, target_ms: float = TILE_TARGET_MS,
              reps: int = 30) -> Calibration:
    """Grow a square GEMM tile until one takes about target_ms, then time it."""
    dt = compute_dtype(device)
    gen = torch.Generator().manual_seed(1234)
    n = 64
    while True:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dt)
        out = torch.empty(n, n, device=device, dtype=dt)
        ms = _time_ms(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out), device, 5, min)
        if ms >= target_ms or n >= MAX_TILE:
            break
        n *= 2
    if ms > 0 and n < MAX_TILE:  # doubling overshoots 8x in work: come back to the target
        n = max(32, int(n * (target_ms / ms) ** (1 / 3)) // 8 * 8)
        a, b, out = a[:n, :n].contiguous(), b[:n, :n].contiguous(), out[:n, :n].contiguous()
    for _ in range(3):  # warm caches and clocks
        torch.matmul(a, b, out=out)
    ms = _time_ms(lambda: torch.matmul(a, b, out=out), device, reps, min)
    return Calibration(device, str(dt).replace("torch.", ""), threads, n, ms,
                       2 * n**3 / (ms * 1e-3) / 1e9)


def layer_gemms(model: ModelSpec, tokens: int) -> list[tuple[int, int, int]]:
    """(rows, inner, out) of each GEMM in one prefill layer at `tokens` prompt tokens.

    GQA/MHA: fused QKV [h -> (heads + 2 kv_heads) head_dim], output [h -> h],
    gate+up [h -> 2 ffn], down [ffn -> h]. MLA (DeepSeek style, approximate): Q [h -> h],
    compressed KV [h -> kv_lora_rank + rope], KV up-projection [kv_lora_rank -> 2 h],
    output [h -> h], and the same MLP shapes."""
    h, ffn = model.hidden_size, model.intermediate_size
    if model.is_mla:
        attn = [(tokens, h, h), (tokens, h, model.kv_lora_rank + model.qk_rope_head_dim),
                (tokens, model.kv_lora_rank, 2 * h), (tokens, h, h)]
    else:
        qkv = (model.num_attention_heads + 2 * model.kv_heads) * model.head_dim
        attn = [(tokens, h, qkv), (tokens, model.num_attention_heads * model.head_dim, h)]
    return attn + [(tokens, h, 2 * ffn), (tokens, ffn, h)]


def layer_flops(model: ModelSpec, tokens: int) -> int:
    return sum(2 * r * k * n for r, k, n in layer_gemms(model, tokens))


def model_error(model: ModelSpec) -> str | None:
    """Why `--layer-compute model` cannot size this model's layer, or None."""
    missing = [f for f in ("hidden_size", "intermediate_size", "num_attention_heads")
               if not getattr(model, f)]
    if missing:
        return (f"--layer-compute model needs {', '.join(missing)} of model {model.name} "
                "(its config lacks them): use --layer-compute-ms instead")
    return None


def model_work_bytes(model: ModelSpec, tokens: int, device: str) -> int:
    """Bytes the model-sized layer allocates: weights once, plus input and output activations."""
    el = torch.finfo(compute_dtype(device)).bits // 8
    gemms = layer_gemms(model, tokens)
    weights = sum(k * n for _, k, n in gemms)
    acts = max(tokens * k for _, k, _ in gemms)
    return (weights + acts) * el + (1 << 24)  # + chunk scratch


class LayerWork:
    """One layer's worth of real compute, as chunks with a poll between them."""

    def __init__(self, chunks: list[Callable[[], None]], device: str, description: dict):
        self.chunks = chunks
        self.device = device
        self.description = description

    def run(self, poll: Callable[[], None] | None = None, device=None, wait: bool = True) -> None:
        """One layer. On an asynchronous device (a kvbench.p2p.devices.Device: CUDA, cpu-async) the
        chunks are queued on its stream and, with `wait`, the host polls until an event
        recorded after the last chunk completes (without: returns once queued); elsewhere
        each chunk runs now, with a poll after it."""
        dev = device
        if dev is None and self.device == "cuda":
            from kvbench.p2p.devices import CUDADevice

            dev = CUDADevice()
        if dev is not None and dev.asynchronous:
            for c in self.chunks:
                dev.run(c)
            if not wait:
                return
            done = dev.record()
            while not done.query():  # the layer's KV exists only once its kernels finish
                if poll:
                    poll()
            return
        for c in self.chunks:
            c()
            if poll:
                poll()

    def time_ms(self, reps: int = 5) -> float:
        return _time_ms(self.run, self.device, reps)


def tile_work(cal: Calibration, layer_ms: float) -> LayerWork:
    """`layer_ms` worth of calibrated GEMM tiles; one correction step against a measured layer."""
    dt = compute_dtype(cal.device)
    gen = torch.Generator().manual_seed(99)
    n = cal.tile_n
    a = torch.randn(n, n, generator=gen).to(device=cal.device, dtype=dt)
    b = torch.randn(n, n, generator=gen).to(device=cal.device, dtype=dt)
    out = torch.empty(n, n, device=cal.device, dtype=dt)

    def tile():
        torch.matmul(a, b, out=out)

    tiles = max(1, round(layer_ms / cal.tile_ms))
    work = LayerWork([tile] * tiles, cal.device, {})
    measured = _time_ms(work.run, cal.device, 5, min)
    if measured > 0:
        tiles = max(1, round(tiles * layer_ms / measured))
        work = LayerWork([tile] * tiles, cal.device, {})
    work.description = {"mode": "ms", "target_layer_ms": layer_ms, "tiles_per_layer": tiles,
                        "layer_flops": 2 * n**3 * tiles}
    return work


class ModelWeights:
    """One prefill layer's weights (shared by every layer and every prompt length), each stored
    transposed [out, inner] so a block of output columns is a contiguous slice."""

    def __init__(self, model: ModelSpec, device: str):
        self.model, self.device = model, device
        self.dtype = compute_dtype(device)
        gen = torch.Generator().manual_seed(7)
        self.wt = [(torch.randn(n, k, generator=gen) * 0.01).to(device=device, dtype=self.dtype)
                   for _, k, n in layer_gemms(model, 1)]


def model_work(model: ModelSpec, tokens: int, cal: Calibration,
               weights: ModelWeights | None = None) -> LayerWork:
    """The GEMMs of one prefill layer, cut into 2-D blocks (token rows x output columns) of
    about CHUNK_TARGET_MS each, so the sender can poll between them. Blocks stay close to
    square in their outer dimensions: thin slices would turn a compute-bound GEMM into a
    memory-bound one and measure the wrong thing.

    One set of weights serves every layer (the time is what matters; one layer of a 70B
    model is already ~1.7 GB in BF16)."""
    weights = weights or ModelWeights(model, cal.device)
    dt = weights.dtype
    gen = torch.Generator().manual_seed(11)
    gemms = layer_gemms(model, tokens)
    x = (torch.randn(tokens * max(k for _, k, _ in gemms), generator=gen) * 0.01).to(
        device=cal.device, dtype=dt)
    flops_target = CHUNK_TARGET_MS * cal.gflops * 1e6
    side_max = 1
    blocks = []
    for (rows, k, n), wt in zip(gemms, weights.wt, strict=True):
        side = max(16, int(math.sqrt(flops_target / (2 * k))))
        r, c = min(rows, side), min(n, side)
        if r < side:  # few tokens: widen the column blocks to keep the chunk's work
            c = min(n, max(c, int(flops_target / (2 * k * r))))
        xin = x[:rows * k].view(rows, k)
        for a in range(0, rows, r):
            for b in range(0, n, c):
                blocks.append((xin, wt, a, min(rows, a + r), b, min(n, b + c)))
        side_max = max(side_max, r * c)
    scratch = torch.empty(side_max, device=cal.device, dtype=dt)

    def chunk(xin, wt, a, b, c0, c1):
        out = scratch[:(b - a) * (c1 - c0)].view(b - a, c1 - c0)
        torch.mm(xin[a:b], wt[c0:c1].t(), out=out)

    chunks = [lambda blk=blk: chunk(*blk) for blk in blocks]
    flops = layer_flops(model, tokens)
    assert flops == sum(2 * (b - a) * xin.shape[1] * (c1 - c0)
                        for xin, _, a, b, c0, c1 in blocks), "blocks must cover every GEMM once"
    return LayerWork(chunks, cal.device, {
        "mode": "model", "tokens": tokens, "layer_flops": flops,
        "gemms": [list(g) for g in gemms], "chunks_per_layer": len(chunks),
        "predicted_layer_ms": flops / (cal.gflops * 1e6),
    })
