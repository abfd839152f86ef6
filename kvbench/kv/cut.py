"""How the KV is cut into the pieces a transport moves, and the sweep that varies it.

A *cut* is everything that changes how many pieces one handoff posts while the bytes stay
the same: the block size (tokens per page), K and V in one page or in separate regions
(`kv`), the request's block ids (`blocks`: contiguous, scattered, merged, or a recorded
file) and the TP pair (prefill TP, decode TP) whose heads split every block.

The *page plan* moves the paged KV page by page, zero copy, in the order a serving engine's
connector addresses it (kvbench.p2p.transports.nixl.engine_shape cites vLLM): per pool (one per layer for
joint pages, per layer and part for split ones), per piece of a page, every block of the
request. A TP pair (P, D) with P != D is measured from the point of view of one decode rank
of decode TP D (kvbench.kv.shards picks its heads and the prefill ranks that serve them):
every block it receives arrives as one piece per serving prefill rank and part, blocks are
heads-major (vLLM's HND layout, so a head group is one contiguous piece), and the serving
prefill ranks' KV sits on rank 0 in one cache each (their concurrency on separate ranks is
what `--pattern sharded` measures). Pieces that are adjacent on both sides and come from one
source are one piece; `merged` block ids also join consecutive whole pages into one piece
(what an engine does when it merges contiguous blocks before posting).

This module is pure (no torch; kvbench.p2p.pages builds the caches and messages from it):
`count_pieces` gives the count a cut posts for any model and prompt without allocating, for
`kvbench plan`, and a test holds it against what the transports actually posted.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import random
from dataclasses import dataclass

from kvbench.errors import UsageError, list_items, parse_int_pair, parse_words
from kvbench.kv.geometry import DType, ModelSpec
from kvbench.kv.shards import ShardError, shard_plan
from kvbench.records.schema.engine import MAX_SIDE_FILE_BYTES, load_block_ids
from kvbench.records.schema.read import read_bounded

KV_PAGES = ("joint", "split")
BLOCK_IDS = ("contiguous", "scattered", "merged")  # or file:PATH
MAX_CUTS = 256  # cuts in one run (each size is measured under every cut)


@dataclass(frozen=True)
class Region:
    """One registered region as the initiator addresses it: `n_blocks` blocks of `block_len`
    bytes, `stride` bytes apart from `base` (a pool, or one piece of each of its pages)."""

    base: int
    stride: int
    n_blocks: int
    block_len: int

    def addr(self, block: int) -> int:
        return self.base + block * self.stride


# ---------------------------------------------------------------------------
# block tables


def read_block_file(path: str) -> dict[str, list[int]]:
    """{"prefill": [...], "decode": [...]} block ids (a recorded allocation), read through the
    typed, bounded model (kvbench.records.schema.engine): UsageError of one line."""
    doc = load_block_ids(path)
    return {"prefill": doc.prefill, "decode": doc.decode}


def file_digest(path: str, what: str) -> str:
    """8 hex digits of the sha256 of a side file's content (read bounded)."""
    data = read_bounded(path, MAX_SIDE_FILE_BYTES, what, missing=f"no such {what}", regular=True)
    return hashlib.sha256(data).hexdigest()[:8]


def block_ids_label(kind: str) -> str:
    """What goes into the spec: the kind, or for a file the hash of its content (a path says
    nothing about what was measured)."""
    if not kind.startswith("file:"):
        return kind
    return f"file#{file_digest(kind[5:], 'block-id file')}"


def block_table(kind: str, need: int, side: str, seed: int = 0) -> list[int]:
    """The block ids one side's request uses (first `need` entries matter): contiguous from 0
    (a fresh engine's allocator; `merged` too), scattered (two apart, shuffled, seeded per
    side: no neighbour is ever the next id, so nothing merges), or a recorded list (file:PATH).
    A bad kind or a file with too few ids is a UsageError of one line."""
    if kind in ("contiguous", "merged"):
        return list(range(need))
    if kind == "scattered":  # (a random draw from a small pool often came out consecutive)
        slots = need + max(1, math.ceil(need / 8))
        rng = random.Random(10_007 + seed * 7919 + (side == "decode"))
        return rng.sample([2 * k + (side == "decode") for k in range(slots)], need)
    if kind.startswith("file:"):
        ids = read_block_file(kind[5:])[side]
        if len(ids) < need:
            raise UsageError(f"block-id file {kind[5:]}: {side}: lists {len(ids)} block ids, the "
                             f"largest request (--sizes) needs {need}")
        return ids[:need]
    raise UsageError(f"unknown block ids {kind!r}: contiguous, scattered, merged or file:PATH")


def pool_blocks(kind: str, need: int, side: str, seed: int = 0, slack: float = 0.125) -> int:
    """Blocks of the pool one side allocates for a request of `need` blocks (as KVCache sizes
    it): `need` plus slack, or up to the largest id the request uses (scattered ids spread
    over about twice the request; a recorded id of 2^31 - 1 is a pool of 2^31 blocks)."""
    pool = need + max(1, math.ceil(need * slack))
    if kind in ("scattered",) or kind.startswith("file:"):
        pool = max(pool, max(block_table(kind, need, side, seed)) + 1)
    return pool


def runs_of(prefill: list[int], decode: list[int]) -> int:
    """Runs of entries whose ids are both the next ids: what merging consecutive pages leaves."""
    if not prefill:
        return 0
    return 1 + sum(1 for i in range(1, len(prefill))
                   if not (prefill[i] == prefill[i - 1] + 1 and decode[i] == decode[i - 1] + 1))


# ---------------------------------------------------------------------------
# a cut, and the declarations that make a sweep of them


@dataclass(frozen=True)
class Cut:
    """One way of cutting the KV. `kv` None: the run's message plan (kvbench.p2p.messages),
    where only the block size is the cut's; otherwise the page plan."""

    block_size: int
    kv: str | None = None
    blocks: str | None = None
    tp: tuple[int, int] = (1, 1)

    @property
    def pages(self) -> bool:
        return self.kv is not None

    @property
    def merged(self) -> bool:
        return self.blocks == "merged"

    def spec(self) -> dict | None:
        """The spec's `cut` entry (None for the message plan: its spec is what it always was)."""
        if not self.pages:
            return None
        return {"kv": self.kv, "blocks": block_ids_label(self.blocks),
                "tp": f"{self.tp[0]}:{self.tp[1]}"}

    @property
    def label(self) -> str:
        if not self.pages:
            return f"bs {self.block_size}"
        tp = "" if self.tp == (1, 1) else f" tp {self.tp[0]}:{self.tp[1]}"
        return f"bs {self.block_size} {self.kv} {self.blocks}{tp}"


MAX_TP = 65_536  # a parallel degree, as `plan export --tp` bounds it


def parse_tp_pairs(text: str) -> list[tuple[int, int]]:
    """'1:1,2:1,4:1' -> [(1, 1), (2, 1), (4, 1)] (prefill TP : decode TP), through the one
    list and integer rules (kvbench.errors): ASCII digits, 1 .. 65,536, no empty item."""
    return [parse_int_pair(item, "--tp-pair", ":", 1, MAX_TP, "PREFILL_TP:DECODE_TP (e.g. 2:1)")
            for item in list_items(text, "--tp-pair")]


def declared_cuts(block_sizes: list[int], kv: str | None, blocks: str | None, tp: str | None,
                  pages: bool) -> list[Cut]:
    """Every combination of the declared values, block size outermost. `pages`: the page plan
    even when no page option was given (the engine-shaped handoff). Raises ValueError."""
    pages = pages or any(v is not None for v in (kv, blocks, tp))
    if not pages:
        return [Cut(bs) for bs in block_sizes]
    # None is "not given" (the default); '' is a value, and refused (kvbench.errors.list_items)
    kvs = parse_words("joint" if kv is None else kv, "--kv-pages", KV_PAGES)
    ids = parse_words("contiguous" if blocks is None else blocks, "--block-ids", BLOCK_IDS,
                      ("file:",))
    for b in ids:
        block_table(b, 1, "prefill")  # a file is read (and refused) before anything starts
    pairs = parse_tp_pairs(tp) if tp is not None else [(1, 1)]
    cuts = [Cut(bs, k, b, t) for bs, k, b, t in itertools.product(block_sizes, kvs, ids, pairs)]
    if len(cuts) > MAX_CUTS:
        raise ValueError(f"{len(cuts)} cuts declared; at most {MAX_CUTS} in one run")
    if len(set(cuts)) != len(cuts):
        raise ValueError("the same cut is declared twice (a value repeated in a list)")
    return cuts


# ---------------------------------------------------------------------------
# what a cut means for a model: who holds which heads, and the pieces of a page


@dataclass(frozen=True)
class Piece:
    """One contiguous piece of a page: from source `source`'s page at `remote` to the decode
    page at `local` (byte offsets), `length` bytes."""

    source: int
    local: int
    remote: int
    length: int


@dataclass(frozen=True)
class PageLayout:
    """A cut applied to a model: the decode rank's heads, each serving prefill rank's heads,
    whether blocks are heads-major, page bytes on each side, and the pieces of one page."""

    decode_heads: tuple[int, ...]
    source_heads: tuple[tuple[int, ...], ...]
    source_ranks: tuple[int, ...]  # the prefill TP ranks that serve the decode rank
    hnd: bool
    decode_page: int
    source_page: int
    pieces: tuple[Piece, ...]
    pools_per_layer: int  # split pages: one pool per part; joint: one

    @property
    def whole_pages(self) -> bool:
        """One piece per page on both sides: consecutive pages can join into one piece."""
        return (len(self.pieces) == 1 and self.pieces[0].length == self.decode_page
                == self.source_page)


def _edge_span(heads: tuple[int, ...], held: tuple[int, ...], side: str) -> int:
    """Index of the edge's first head in what a side holds; the edge must be a contiguous run."""
    lo = held.index(heads[0])
    if held[lo:lo + len(heads)] != heads:
        raise ShardError(f"the {side} side holds heads {list(held)}, the TP pair sends "
                         f"{list(heads)}: not one contiguous group")
    return lo


@functools.lru_cache(maxsize=64)
def _decode_rank0(kv_heads: int, p_tp: int, d_tp: int, mla: bool) -> tuple:
    """(edges into decode rank 0, its heads, each serving prefill rank's heads): the shard
    plan once per TP pair, however many prompts, cuts and block sizes a plan counts."""
    plan = shard_plan(kv_heads, p_tp, d_tp, mla)
    edges = tuple(e for e in plan.edges if e.dst == p_tp)
    return edges, tuple(plan.decode_heads[0]), tuple(tuple(plan.prefill_heads[e.src]) for e in edges)


def page_layout(model: ModelSpec, dtype: DType, cut: Cut) -> PageLayout:
    """Pieces of one page for decode TP rank 0 under the cut's TP pair. Raises ShardError."""
    edges, dh, sh = _decode_rank0(model.kv_heads, *cut.tp, model.is_mla)
    parts = model.parts
    per_head = cut.block_size * model.width * dtype.bytes  # one head of one part of one block
    in_page = parts if cut.kv == "joint" else 1
    hnd = any(tuple(e.heads) != dh or tuple(e.heads) != held for e, held in zip(edges, sh, strict=True))
    pieces: list[Piece] = []
    for part in range(in_page):
        for k, (e, held) in enumerate(zip(edges, sh, strict=True)):
            heads = tuple(e.heads)
            lo_d, lo_s = _edge_span(heads, dh, "decode"), _edge_span(heads, held, "prefill")
            piece = Piece(k, (part * len(dh) + lo_d) * per_head,
                          (part * len(held) + lo_s) * per_head, len(heads) * per_head)
            last = pieces[-1] if pieces else None
            if (last is not None and last.source == k and last.local + last.length == piece.local
                    and last.remote + last.length == piece.remote):
                pieces[-1] = Piece(k, last.local, last.remote, last.length + piece.length)
            else:
                pieces.append(piece)
    if len({len(h) for h in sh}) != 1:
        raise ShardError("serving prefill ranks hold different head counts")
    return PageLayout(dh, sh, tuple(e.src for e in edges), hnd, in_page * len(dh) * per_head,
                      in_page * len(sh[0]) * per_head, tuple(pieces),
                      1 if cut.kv == "joint" else parts)


def layer_blocks(model: ModelSpec, tokens: int, block_size: int, layer: int) -> int:
    """Blocks a layer's KV takes (sliding-window layers, the last ones, keep the window)."""
    return model.layer_blocks(tokens, block_size, layer)


def count_pieces(model: ModelSpec, dtype: DType, tokens: int, cut: Cut,
                 merge_adjacent: bool = False) -> int:
    """Pieces one handoff of `tokens` posts under the page plan: per layer, pools x pieces per
    page x blocks, or x runs of consecutive ids where consecutive whole pages join (`merged`
    block ids; `merge_adjacent`: the transport joins them itself, as NIXL and ipc do)."""
    lay = page_layout(model, dtype, cut)
    join = lay.whole_pages and (cut.merged or merge_adjacent)
    if cut.blocks.startswith("file:"):  # a recorded file must hold the request's ids (<= 10^6)
        need = layer_blocks(model, tokens, cut.block_size, 0)
        for side in ("prefill", "decode"):
            block_table(cut.blocks, need, side)
    total = 0
    for layer in range(model.layers):
        nb = layer_blocks(model, tokens, cut.block_size, layer)
        per_pool = _joined_runs(cut.blocks, nb) if join else nb * len(lay.pieces)
        total += lay.pools_per_layer * per_pool
    return total


def _joined_runs(kind: str, nb: int) -> int:
    """Runs of consecutive ids in the first `nb` entries of both sides' tables, by formula where
    the kind has one (no table of 10^9 ids is built to count 1): contiguous and merged ids
    are one run; scattered ids are never the next id (even ids on one side), so every entry
    is its own run; a recorded file (at most 10^6 ids) is counted from its lists."""
    if kind in ("contiguous", "merged"):
        return 1 if nb else 0
    if kind == "scattered":
        return nb
    need = max(nb, 1)
    return runs_of(block_table(kind, need, "prefill")[:nb], block_table(kind, need, "decode")[:nb])


def pool_bytes(model: ModelSpec, dtype: DType, tokens: int, cut: Cut, side: str) -> int:
    """Bytes of the pools cut_data allocates on one side (every cache, every layer, each pool
    up to the largest id its table uses): what the memory check compares with the memory
    available before anything is allocated."""
    lay = page_layout(model, dtype, cut)
    need = layer_blocks(model, tokens, cut.block_size, 0)
    per_head = model.layers * model.parts * cut.block_size * model.width * dtype.bytes  # one block, all layers
    heads = [lay.decode_heads] if side == "decode" else list(lay.source_heads)
    return sum(pool_blocks(cut.blocks, need, side, seed=k) * per_head * len(held)
               for k, held in enumerate(heads))
