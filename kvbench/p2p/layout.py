"""Real KV-shaped tensors: allocation (contiguous or paged), seeded fill, and checking.

Contiguous: every (layer, K/V) tensor `[tokens, heads, head_dim]` is a view into one
backing allocation, so a "whole" handoff can send it as one message without a copy.

Paged: per (layer, K/V) a pool `[pool_blocks, block_size, heads, head_dim]`, and the
request's blocks are scattered through it by a block table, as in a serving engine's
cache. The decode side has its own pool and its own (different) block table.

Every element is a seeded function of (origin, layer, K/V, token, global head, dim), so
the receiver can verify each element without the sender's copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvbench.kv.geometry import DType, ModelSpec

# Odd multipliers: a shift by one token, head or dim changes every value.
_T, _H, _D, _L, _P, _O = 40503, 9973, 2654435761 % 65521, 7919, 104729, 1299709
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_CHUNK = 1 << 26  # elements per step when filling raw buffers


def torch_dtype(dtype: DType) -> torch.dtype:
    return getattr(torch, dtype.torch_name)


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised tensor. Host memory comes from numpy, which advises transparent huge
    pages for large arrays (torch's allocator does not): fewer TLB misses in the copy
    engines, measured ~1.4x faster MPI shared-memory transfers on this project's CI host.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    import numpy as np

    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.empty(math.prod(shape) * itemsize, dtype=np.uint8))
    return raw.view(dtype).view(shape)


def _grid(tokens: int, heads: Sequence[int], width: int, device) -> torch.Tensor:
    """The (token, head, dim) part of the pattern, shared by every layer (int64)."""
    t = torch.arange(tokens, dtype=torch.int64, device=device).view(-1, 1, 1) * _T
    h = torch.tensor(list(heads), dtype=torch.int64, device=device).view(1, -1, 1) * _H
    d = torch.arange(width, dtype=torch.int64, device=device).view(1, 1, -1) * _D
    return t + h + d


def _to_int_view(values: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Map int64 pattern values onto the int type with the element's width, wrapping safely."""
    bits = 8 * itemsize
    if bits == 32:
        return (values & 0x7FFFFFFF).to(torch.int32)
    return ((values & ((1 << bits) - 1)) - (1 << (bits - 1))).to(_INT_VIEW[itemsize])


def _part_const(origin: int, layer: int, part: int, itemsize: int) -> int:
    """The (origin, layer, part) offset, as a signed value of the element's width."""
    bits = 8 * itemsize
    c = (origin * _O + layer * _L + part * _P) % (1 << bits)
    return c - (1 << bits) if c >= 1 << (bits - 1) else c


@dataclass
class KVSpec:
    """What one rank holds: the model's KV for `tokens`, restricted to `heads`."""

    model: ModelSpec
    dtype: DType
    tokens: int
    heads: list[int] = field(default_factory=list)  # global kv-head indices held here
    layout: str = "contiguous"  # or "paged"
    block_size: int = 16
    origin: int = 0  # seeds the values (the prefill side's identity)
    # paged only: "split" keeps K and V of a layer in separate pools (one page per part);
    # "joint" puts a block's K and V in one page of its layer, as vLLM 0.32's CPU/FlashAttention
    # caches do (kvbench.p2p.transports.nixl.engine_shape)
    pages: str = "split"
    # paged only: heads-major blocks ([heads, block_size, width], vLLM's HND layout), so a
    # group of heads is one contiguous piece of a block (a TP pair that splits heads per
    # block, kvbench.kv.cut); False keeps token-major blocks ([block_size, heads, width])
    hnd: bool = False

    def __post_init__(self):
        if not self.heads:
            self.heads = list(range(self.n_heads_total))

    # The geometry is kvbench.kv.geometry's (ModelSpec): one calculator from tokens to bytes.
    @property
    def n_heads_total(self) -> int:
        return self.model.n_heads

    @property
    def width(self) -> int:
        return self.model.width

    @property
    def parts(self) -> int:
        """Tensors per layer: K and V, or MLA's single latent."""
        return self.model.parts

    def layer_tokens(self, layer: int) -> int:
        """Tokens a layer keeps: sliding-window layers (the last ones) keep the window."""
        return self.model.layer_tokens(self.tokens, layer)

    def layer_blocks(self, layer: int) -> int:
        return self.model.layer_blocks(self.tokens, self.block_size, layer)

    def tensor_tokens(self, layer: int) -> int:
        """Tokens stored for one layer tensor (paged rounds up to whole blocks)."""
        if self.layout == "paged":
            return self.layer_blocks(layer) * self.block_size
        return self.layer_tokens(layer)

    @property
    def row_elems(self) -> int:
        return len(self.heads) * self.width

    @property
    def payload_bytes(self) -> int:
        """Bytes a handoff moves: every (layer, part) tensor at its stored token count."""
        return self.model.held_bytes(self.tokens, self.dtype, len(self.heads),
                                     self.block_size if self.layout == "paged" else None)


class KVCache:
    """The tensors one rank holds for one request, plus how to fill and check them."""

    def __init__(self, spec: KVSpec, device: str = "cpu", table_seed: int = 0, slack: float = 0.125,
                 pack_kernel: str = "torch", table: Sequence[int] | None = None):
        """`table` (paged only): one block table shared by every layer, as an engine's block
        manager hands out (a layer uses its first layer_blocks entries); None draws a random
        table per layer from `table_seed`."""
        # "torch": index_select/index_copy_; "cuda": cuda/kv_pack.cu (paged on a GPU only)
        self.pack_kernel = pack_kernel if spec.layout == "paged" else "torch"
        self.spec = spec
        self.device = torch.device(device)
        self.tdtype = torch_dtype(spec.dtype)
        m, s = spec.model, spec
        H, W = len(s.heads), s.width
        self.tensors: list[torch.Tensor] = []  # per (layer, part): [tokens, H, W] or pool
        self.block_tables: list[torch.Tensor] = []  # per layer (paged only), on the device
        self.block_ids: list[list[int]] = []  # the same tables on the host (no device reads)
        if s.layout == "contiguous":
            total = sum(s.parts * s.layer_tokens(layer) * H * W for layer in range(m.layers))
            self.backing = empty(total, self.tdtype, self.device)
            off = 0
            for layer in range(m.layers):
                n = s.layer_tokens(layer) * H * W
                for _ in range(s.parts):
                    self.tensors.append(self.backing[off:off + n].view(s.layer_tokens(layer), H, W))
                    off += n
        elif s.layout == "paged":
            need = max(s.layer_blocks(layer) for layer in range(m.layers))
            self.pool_blocks = need + max(1, math.ceil(need * slack))
            if table is not None:
                if len(table) < need or min(table) < 0 or len(set(table)) != len(table):
                    raise ValueError(f"block table needs {need} distinct non-negative ids, got "
                                     f"{len(table)} ({len(set(table))} distinct)")
                self.pool_blocks = max(self.pool_blocks, max(table) + 1)
            joint = s.pages == "joint"
            block = (H, s.block_size, W) if s.hnd else (s.block_size, H, W)
            shape = ((m.layers, self.pool_blocks, s.parts, *block) if joint else
                     (m.layers, s.parts, self.pool_blocks, *block))
            self.backing = empty(shape, self.tdtype, self.device)
            gen = torch.Generator().manual_seed(10_007 + table_seed)
            for layer in range(m.layers):
                if table is None:
                    ids = torch.randperm(self.pool_blocks, generator=gen)[: s.layer_blocks(layer)]
                else:
                    ids = torch.tensor(list(table[: s.layer_blocks(layer)]), dtype=torch.int64)
                self.block_ids.append(ids.tolist())
                self.block_tables.append(ids.to(self.device))
                for part in range(s.parts):
                    pool = self.backing[layer, :, part] if joint else self.backing[layer, part]
                    # heads-major storage seen token-major: [pool, block_size, H, W] everywhere
                    self.tensors.append(pool.transpose(1, 2) if s.hnd else pool)
        else:
            raise ValueError(f"unknown layout {s.layout}")

    # -- views -------------------------------------------------------------

    def index(self, layer: int, part: int) -> int:
        return layer * self.spec.parts + part

    def block_views(self, layer: int, part: int) -> list[torch.Tensor]:
        """The request's blocks of one (layer, part) in block-table order (paged only). Read
        from the host copy of the table: `int()` on a CUDA tensor's element is one device sync
        per block, and a block plan has tens of thousands."""
        if self.spec.hnd:  # a token-major view of a heads-major block is no contiguous message
            raise ValueError("heads-major blocks move as pages (kvbench.kv.cut), not as views")
        pool = self.tensors[self.index(layer, part)]
        return [pool[b] for b in self.block_ids[layer]]

    def pools(self) -> list[torch.Tensor]:
        """Per pool, in registration order (layer, then part for split pages): the tensor whose
        dim 0 is the block id and whose [b] is one page, contiguous (joint: the block's K and V
        together; split: one part)."""
        s = self.spec
        if s.pages == "joint":
            return [self.backing[layer] for layer in range(s.model.layers)]
        return [self.backing[layer, part] for layer in range(s.model.layers)
                for part in range(s.parts)]

    def gather(self, layer: int, part: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Token-ordered `[tokens, H, W]` of one tensor (packs paged blocks)."""
        t = self.tensors[self.index(layer, part)]
        if self.spec.layout == "contiguous":
            return t if out is None else out.copy_(t)
        if self.pack_kernel == "cuda":
            from kvbench.p2p.cuda_kernels import gather_blocks

            nb = self.block_tables[layer].numel()
            if out is None:
                out = torch.empty((nb, *t.shape[1:]), dtype=t.dtype, device=t.device)
            gather_blocks(t, self.block_tables[layer], out)
            return out.view(-1, t.shape[-2], t.shape[-1])
        ivt = _INT_VIEW[self.spec.dtype.bytes]  # index ops lack FP8 kernels; bytes are bytes
        packed = torch.index_select(t.view(ivt), 0, self.block_tables[layer],
                                    out=None if out is None else out.view(ivt))
        return packed.view(self.tdtype).view(-1, t.shape[-2], t.shape[-1])

    def scatter(self, layer: int, part: int, packed: torch.Tensor) -> None:
        """Inverse of gather: write token-ordered data into this cache's blocks."""
        t = self.tensors[self.index(layer, part)]
        if self.spec.layout == "contiguous":
            t.copy_(packed.view_as(t))
            return
        if self.pack_kernel == "cuda":
            from kvbench.p2p.cuda_kernels import scatter_blocks

            scatter_blocks(packed, self.block_tables[layer], t)
            return
        ivt = _INT_VIEW[self.spec.dtype.bytes]
        t.view(ivt).index_copy_(0, self.block_tables[layer], packed.view(ivt).view(-1, *t.shape[1:]))

    # -- seeded contents -----------------------------------------------------

    def _expected(self, grid: torch.Tensor, layer: int, part: int) -> torch.Tensor:
        # One integer add per element (wrapping at the element's width): cheap enough to
        # fill and check multi-GB caches in seconds.
        n = self.spec.tensor_tokens(layer)
        return grid[:n] + _part_const(self.spec.origin, layer, part, self.spec.dtype.bytes)

    def _grid(self) -> torch.Tensor:
        """The (token, head, dim) pattern in the element's integer width, shared by layers."""
        s = self.spec
        tokens = max(s.tensor_tokens(layer) for layer in range(s.model.layers))
        return _to_int_view(_grid(tokens, s.heads, s.width, self.device), s.dtype.bytes)

    def fill(self) -> None:
        """Write the seeded pattern into every element of the request's KV."""
        grid = self._grid()
        for layer in range(self.spec.model.layers):
            for part in range(self.spec.parts):
                if self.spec.layout == "contiguous":  # write in place, no temporary
                    n = self.spec.tensor_tokens(layer)
                    c = _part_const(self.spec.origin, layer, part, self.spec.dtype.bytes)
                    t = self.tensors[self.index(layer, part)]
                    torch.add(grid[:n], c, out=t.view(grid.dtype))
                else:
                    self.scatter(layer, part, self._expected(grid, layer, part).view(self.tdtype))

    def clear(self) -> None:
        self.backing.view(_INT_VIEW[self.spec.dtype.bytes]).fill_(0)

    def count_wrong(self) -> int:
        """Elements that differ from the seeded pattern (compared as integers: NaN-safe)."""
        grid = self._grid()
        ivt = _INT_VIEW[self.spec.dtype.bytes]
        wrong = 0
        for layer in range(self.spec.model.layers):
            for part in range(self.spec.parts):
                got = self.gather(layer, part).view(ivt)
                wrong += int(torch.count_nonzero(got != self._expected(grid, layer, part)))
        return wrong

    @property
    def nbytes(self) -> int:
        return self.backing.numel() * self.backing.element_size()


class RawBuffer:
    """A plain byte buffer for `--bytes` link sweeps, with the same fill/check contract."""

    def __init__(self, nbytes: int, device: str = "cpu", origin: int = 0):
        self.device = torch.device(device)
        self.origin = origin
        self.backing = empty(nbytes, torch.uint8, self.device)

    def _expected(self, start: int, stop: int) -> torch.Tensor:
        idx = torch.arange(start, stop, dtype=torch.int64, device=self.device)
        return _to_int_view(idx * _T + self.origin * _O, 1)

    _PERIOD = 256  # byte i holds the low 8 bits of i*_T + c: the pattern repeats every 256 B

    def _rows(self, a: int, b: int) -> torch.Tensor:
        """Bytes [a, b) (multiples of the period) as rows of one period each."""
        return self.backing.view(torch.int8)[a:b].view(-1, self._PERIOD)

    def _spans(self):
        """(start, stop) of whole-period chunks of at most _CHUNK bytes, then the tail."""
        n, p = self.backing.numel(), self._PERIOD
        whole = n - n % p
        step = max(p, _CHUNK - _CHUNK % p)
        return [(a, min(a + step, whole)) for a in range(0, whole, step)], (whole, n)

    def fill(self) -> None:
        """One period computed, then copied across the buffer (no per-byte arithmetic)."""
        period = self._expected(0, self._PERIOD)
        spans, (t0, t1) = self._spans()
        for a, b in spans:
            rows = self._rows(a, b)
            rows.copy_(period.expand_as(rows))
        self.backing.view(torch.int8)[t0:t1] = period[: t1 - t0]

    def clear(self) -> None:
        self.backing.fill_(0)

    def count_wrong(self) -> int:
        period = self._expected(0, self._PERIOD)
        spans, (t0, t1) = self._spans()
        wrong = sum(int(torch.count_nonzero(self._rows(a, b) != period)) for a, b in spans)
        return wrong + int(torch.count_nonzero(self.backing.view(torch.int8)[t0:t1]
                                               != period[: t1 - t0]))

    @property
    def nbytes(self) -> int:
        return self.backing.numel()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: what transports move."""
    return t.reshape(-1).view(torch.uint8)
