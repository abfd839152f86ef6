"""Who holds which KV heads under tensor parallelism, and who sends which heads to whom.

Pure (no torch, no MPI): the sharded pattern builds its edges from it, and the descriptor
sweep (kvbench.kv.cut) and `kvbench plan` count the pieces a TP pair cuts each block into.

TP rank r of a side holds kv heads [r K/TP, (r+1) K/TP) when TP divides K; when TP is a
multiple of K each head lives on TP/K consecutive ranks (replicated); MLA's latent is not
split by heads, so every rank of both sides holds all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.errors import UsageError
from kvbench.kv.geometry import tp_split


class ShardError(UsageError, ValueError):
    """A TP layout that cannot shard the model's KV heads (one clear line). A UsageError, so
    a caller that does not word it with its own flag still ends in one line, exit 2."""


def heads_by_rank(tp: int, kv_heads: int, mla: bool, side: str) -> list[list[int]]:
    """Global kv heads each TP rank of one side holds (the split is kvbench.kv.geometry's)."""
    if mla:
        return [[0] for _ in range(tp)]
    split = tp_split(kv_heads, tp)
    if split is None and tp <= kv_heads:
        raise ShardError(f"--{side}-tp {tp} does not divide the model's {kv_heads} kv heads: "
                         f"each rank must hold whole heads (use a TP that divides {kv_heads}, "
                         f"or a multiple of {kv_heads} to replicate heads)")
    if split is None:
        raise ShardError(f"--{side}-tp {tp} is more than the model's {kv_heads} kv heads but not a "
                         f"multiple of it: heads cannot be replicated evenly")
    n, copies = split
    return [list(range((r // copies) * n, (r // copies + 1) * n)) for r in range(tp)]


@dataclass(frozen=True)
class Edge:
    src: int  # world rank on the prefill side
    dst: int  # world rank on the decode side
    heads: tuple[int, ...]  # global kv heads it carries


@dataclass
class ShardPlan:
    prefill_tp: int
    decode_tp: int
    kv_heads: int  # distinct heads (1 for MLA: the latent)
    mla: bool
    prefill_heads: list[list[int]]  # by prefill TP rank (= world rank)
    decode_heads: list[list[int]]  # by decode TP rank (world rank = prefill_tp + j)
    edges: list[Edge] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.prefill_tp + self.decode_tp

    def copies(self, side: str) -> int:
        """Ranks of a side holding each head (1: no replication)."""
        holders = self.prefill_heads if side == "prefill" else self.decode_heads
        return sum(1 for hs in holders if 0 in hs)

    @property
    def replicated(self) -> dict:
        return {"prefill": self.copies("prefill"), "decode": self.copies("decode")}

    @property
    def note(self) -> str:
        if self.mla:
            return "MLA latent is not split by heads: every rank of both sides holds all of it"
        parts = []
        for side, tp in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            if self.copies(side) > 1:
                parts.append(f"{side}: kv_heads {self.kv_heads} < TP {tp}, each head replicated on "
                             f"{self.copies(side)} ranks")
        return "; ".join(parts)

    def role(self, rank: int) -> str:
        return "prefill" if rank < self.prefill_tp else "decode"

    def held(self, rank: int) -> list[int]:
        return (self.prefill_heads[rank] if rank < self.prefill_tp
                else self.decode_heads[rank - self.prefill_tp])

    def edges_of(self, rank: int) -> list[Edge]:
        return [e for e in self.edges if rank in (e.src, e.dst)]

    def describe(self) -> list[str]:
        def span(hs):
            hs = list(hs)
            if len(hs) > 1 and hs == list(range(hs[0], hs[-1] + 1)):
                return f"{hs[0]}-{hs[-1]}"
            return ",".join(map(str, hs))

        what = "latent" if self.mla else "heads"
        lines = [f"send plan: prefill TP {self.prefill_tp} ({_ranks(0, self.prefill_tp)}) -> "
                 f"decode TP {self.decode_tp} ({_ranks(self.prefill_tp, self.world)}), "
                 f"{self.kv_heads} kv {'latent' if self.mla else 'heads'}"
                 + (f"; {self.note}" if self.note else "")]
        for r in range(self.prefill_tp):
            out = [f"rank {e.dst} {what} {span(e.heads)}" for e in self.edges if e.src == r]
            lines.append(f"  prefill rank {r} holds {what} {span(self.held(r))}: sends "
                         + ("; ".join(out) if out else "nothing (another holder serves every decode rank)"))
        for r in range(self.prefill_tp, self.world):
            inn = [f"rank {e.src} ({span(e.heads)})" for e in self.edges if e.dst == r]
            lines.append(f"  decode rank {r} holds {what} {span(self.held(r))}: from "
                         + ", ".join(inn))
        return lines

    def as_dict(self) -> dict:
        return {"prefill_tp": self.prefill_tp, "decode_tp": self.decode_tp,
                "kv_heads": self.kv_heads, "mla": self.mla,
                "prefill_heads": self.prefill_heads, "decode_heads": self.decode_heads,
                "edges": [{"src": e.src, "dst": e.dst, "heads": list(e.heads)} for e in self.edges]}


def shard_plan(kv_heads: int, prefill_tp: int, decode_tp: int, mla: bool = False) -> ShardPlan:
    """Who sends which global heads to whom. Pure; raises ShardError on layouts that cannot
    shard. Each decode rank's head comes from the least-loaded prefill holder (ties: lowest
    rank), so replicated prefill heads spread their sends."""
    if prefill_tp < 1 or decode_tp < 1:
        raise ShardError("--prefill-tp and --decode-tp must be at least 1")
    k = 1 if mla else kv_heads
    ph = heads_by_rank(prefill_tp, k, mla, "prefill")
    dh = heads_by_rank(decode_tp, k, mla, "decode")
    chosen: dict[tuple[int, int], list[int]] = {}
    asked = [0] * k  # how often each head was asked for so far
    for j, heads in enumerate(dh):
        for h in heads:
            src = _holder(h, asked[h], prefill_tp, k)
            asked[h] += 1
            chosen.setdefault((src, prefill_tp + j), []).append(h)
    edges = [Edge(s, d, tuple(sorted(hs))) for (s, d), hs in sorted(chosen.items(),
                                                                  key=lambda kv: (kv[0][1], kv[0][0]))]
    plan = ShardPlan(prefill_tp, decode_tp, k, mla, ph, dh, edges)
    got: dict[int, list[int]] = {}
    for e in edges:
        got.setdefault(e.dst, []).extend(e.heads)
    for j, heads in enumerate(dh):  # invariant: every decode head arrives exactly once
        assert sorted(got.get(prefill_tp + j, [])) == sorted(heads), (j, got.get(prefill_tp + j), heads)
    return plan


def _holder(head: int, asked: int, prefill_tp: int, kv_heads: int) -> int:
    """The prefill rank that serves the `asked`-th request for `head`: the least-loaded of its
    holders, ties to the lowest rank. By formula, not by scanning every rank per head (65,536
    ranks a side took minutes): with TP <= K one rank holds each head; with TP a multiple of K
    the head's holders are TP/K consecutive ranks holding nothing else, so their loads move
    only with this head's requests and the least-loaded is the next in turn."""
    if prefill_tp <= kv_heads:
        return head // (kv_heads // prefill_tp)
    copies = prefill_tp // kv_heads
    return head * copies + asked % copies


def _ranks(a: int, b: int) -> str:
    return f"rank {a}" if b - a == 1 else f"ranks {a}-{b - 1}"
