"""Which kind of link carried a run's bytes, read from what the transport itself reported.

Every transport records `transport_info.path` in its own words: NCCL's channel transports
("P2P/CUMEM/read", "SHM/direct/direct", "NET/IB/0/GDRDMA", "NET/Socket/0", parsed from its
debug log by `kvbench.links.nccl_log`), the UCX protocols NIXL selected ("UCX RMA write:
rc_mlx5/mlx5_0:1 (zero-copy); ..."), the MPI transport's "host"/"host-staged"/
"device-direct", Gloo's "TCP sockets". This module maps them onto one vocabulary:

    nvlink | pcie | same-device | shm | rdma | rdma-host-staged | tcp | host | unknown

so that `kvbench fit --expect-link nvlink` can flag a group whose bytes went another way
(an "NVLink" job that NCCL ran over NET/Socket or SHM). The path is the path of the KV's
own bytes: of UCX's rows only those between the KV's memory on both sides
(kvbench.links.ucx_rows); `same-device` when both ranks use one GPU (their UUIDs, or weaker
evidence for records without them, said in the evidence); `rdma-host-staged` when the network
reads a bounce buffer in host memory instead of the GPU (NCCL NET/IB without /GDRDMA, UCX
RDMA rows that stage through cuda_copy), never GPUDirect `rdma`. A path is made of parts
(one per NCCL transport or UCX lane); some evidence cannot tell two kinds apart (NCCL P2P
without its topology line, cuda_ipc between two GPUs: NVLink or PCIe) and its part holds
both. A part without the expected kind, or UCX's software emulation, is a mismatch, said
with the causes the record's evidence names (kvbench.links.linkcauses).

It also names the links a job can declare (`KVBENCH_LINK=ib-ndr`): the kind to expect and
the line rate in decimal GB/s that arms the fit's "rate above the line rate" check.

Which rules read which record is each transport's own choice, not this module's: a transport
maps its `transport_info` onto these kinds in its `link_path` hook (kvbench.p2p.transports.
base.Transport), with the readers here (classify_nccl, classify_ucx_info, ...), and
kvbench.p2p.transports.classify_record picks the hook by the record's transport. This
module keeps the vocabulary (kinds, LinkPath, causes, pair facts) and the rules for records
no installed transport declares (`by_path`: the path's own words). It never branches on a
transport's name: the ipc transport was once added without a branch here, and every ipc
record read `unknown`.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvbench.links import linkcauses, ucx_rows
from kvbench.links.linkcauses import Cause, Evidence

KINDS = ("nvlink", "pcie", "same-device", "shm", "rdma", "rdma-host-staged", "tcp", "host",
         "unknown")
EXPECTABLE = tuple(k for k in KINDS if k != "unknown")

# Declared links: (kind, one-way line rate in decimal GB/s). The rate is the link's signalling
# rate per direction after line coding, an upper bound no payload rate can exceed.
DECLARED_LINKS: dict[str, tuple[str, float, str]] = {
    "nvlink3": ("nvlink", 300.0, "A100 NVLink 3: 12 links x 25 GB/s per direction"),
    "nvlink4": ("nvlink", 450.0, "H100/H200 NVLink 4: 18 links x 25 GB/s per direction"),
    "nvlink5": ("nvlink", 900.0, "B200/GB200 NVLink 5: 18 links x 50 GB/s per direction"),
    "pcie4": ("pcie", 31.5, "PCIe Gen4 x16: 16 GT/s x 16 lanes, 128b/130b"),
    "pcie5": ("pcie", 63.0, "PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b"),
    "ib-hdr": ("rdma", 25.0, "InfiniBand HDR / 200 GbE RoCE: 200 Gbit/s"),
    "ib-ndr": ("rdma", 50.0, "InfiniBand NDR / 400 GbE RoCE: 400 Gbit/s"),
    "ib-xdr": ("rdma", 100.0, "InfiniBand XDR / 800 GbE RoCE: 800 Gbit/s"),
    "eth-10g": ("tcp", 1.25, "10 GbE, TCP"),
    "eth-25g": ("tcp", 3.125, "25 GbE, TCP"),
    "eth-100g": ("tcp", 12.5, "100 GbE, TCP"),
    "eth-400g": ("tcp", 50.0, "400 GbE, TCP"),
}


@dataclass(frozen=True)
class LinkPath:
    """The kinds of link the evidence allows (one, or several when it cannot tell them apart),
    and the evidence in the transport's own words."""

    kinds: frozenset[str]
    evidence: str
    parts: tuple[frozenset[str], ...] = ()  # per carrier the kinds it may be; () = (kinds,)
    emulated: bool = False  # UCX's software emulation carried the KV
    causes: tuple[Cause, ...] = ()  # why it is not the link it should be (kvbench.links.linkcauses)
    ucx_tls: str | None = None  # UCX_TLS in force, for the cause of an expected link

    @property
    def label(self) -> str:
        return "|".join(k for k in KINDS if k in self.kinds)

    def fails(self, expect: str) -> bool:
        """Some part of the KV's path cannot be the expected kind, or UCX emulated it."""
        return self.emulated or any(expect not in p for p in (self.parts or (self.kinds,)))

    def explain(self, expect: str | None = None) -> str:
        """The causes (and fixes) of a path that is not the link, as one line."""
        causes = list(self.causes)
        if expect and self.ucx_tls is not None and not any(c.code == "ucx-tls" for c in causes):
            want = linkcauses.WANTED_TLS.get(expect, ())
            if want and not any(linkcauses.tls_allows(self.ucx_tls, t) for t in want):
                causes.insert(0, Cause("ucx-tls", f"UCX_TLS={self.ucx_tls} allows none of "
                                       f"{', '.join(want)}", f"add {want[0]} to UCX_TLS"))
        if not causes and not self.emulated and not self.evidence.startswith("UCX"):
            return ""  # nothing to say beyond the path (MPI, Gloo, NCCL: the path is the cause)
        return linkcauses.explain(causes)


@dataclass(frozen=True)
class PairFacts:
    """A record's facts about its two ranks that the path and its causes depend on."""

    device: str | None = None
    same_host: bool | None = None
    same_gpu: str | None = None  # how both ranks are known to share one GPU
    pids: tuple[int | None, ...] = ()
    pid_ns: tuple[str | None, ...] = ()
    rank_vars: tuple[Mapping[str, str], ...] = ()

    @property
    def memory(self) -> str | None:
        """Where the KV lived: 'cuda' (VRAM) or 'host'; None when the record does not say."""
        return None if self.device is None else "cuda" if self.device == "cuda" else "host"


_Pair = PairFacts  # (its name before transports read it)


def _ranks(rec) -> tuple[int, int]:
    """The prefill and decode rank of a record (its `pair`, else its spec's world, else 0, 1)."""
    pair = rec.get("pair")
    if isinstance(pair, (list, tuple)) and len(pair) == 2:
        return int(pair[0]), int(pair[1])
    world = _get(rec.get("spec"), "world")
    pre, dec = _get(world, "prefill_ranks") or [0], _get(world, "decode_ranks") or [1]
    return int(pre[0]), int(dec[0])


def _get(obj, key: str):
    """A key of a dict, or an attribute of a typed record's part (a spec read by the fit)."""
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _at(seq, i: int) -> dict:
    return seq[i] if isinstance(seq, list) and 0 <= i < len(seq) and isinstance(seq[i], dict) \
        else {}


def _same_gpu(a: dict, b: dict, ea: dict, eb: dict) -> str | None:
    """How both ranks are known to use one GPU (UUIDs; weaker: same host, index and name)."""
    if a.get("uuid") and b.get("uuid"):
        return f"GPU UUID {a['uuid']} on both ranks" if a["uuid"] == b["uuid"] else None
    for x, y, idx in ((a, b, "index"), (ea, eb, "gpu_index")):
        name_x, name_y = x.get("name", x.get("gpu")), y.get("name", y.get("gpu"))
        vis = (x.get("cuda_visible_devices", (x.get("variables") or {}).get("CUDA_VISIBLE_DEVICES")),
               y.get("cuda_visible_devices", (y.get("variables") or {}).get("CUDA_VISIBLE_DEVICES")))
        if (x.get("host") and x.get("host") == y.get("host") and x.get(idx) is not None
                and x.get(idx) == y.get(idx) and name_x == name_y and vis[0] == vis[1]
                and x.get("pci_bus_id") == y.get("pci_bus_id")):
            return (f"weaker evidence, no GPU UUID recorded: same host {x['host']}, device index "
                    f"{x[idx]}, {name_x or 'same name'}"
                    + (f", CUDA_VISIBLE_DEVICES={vis[0]}" if vis[0] is not None else ""))
    return None


def pair_facts(rec) -> PairFacts:
    """The facts of a record's prefill/decode pair: device, hosts, GPUs, PIDs, variables."""
    i, j = _ranks(rec)
    device = rec.get("device")
    hosts = rec.get("hosts") or []
    env = rec.get("env") or {}
    ranks = env.get("ranks") if isinstance(env, dict) else None
    ea, eb = _at(ranks, i), _at(ranks, j)
    same_host = hosts[i] == hosts[j] if max(i, j) < len(hosts) else None
    same_gpu = (_same_gpu(_at(rec.get("gpus"), i), _at(rec.get("gpus"), j), ea, eb)
                if device == "cuda" else None)
    rank_vars = tuple(e.get("variables") for e in (ea, eb) if isinstance(e.get("variables"), dict))
    return PairFacts(str(device) if device else None, same_host, same_gpu,
                 (ea.get("pid"), eb.get("pid")), (ea.get("pid_namespace"), eb.get("pid_namespace")),
                 rank_vars)


# ---------------------------------------------------------------------------
# NCCL

# NCCL's graph path types between two GPUs (topoPathTypeStr): NVLink, directly or through
# an NVSwitch/another GPU; everything else between GPUs is PCIe (or the CPU's fabric).
_NCCL_NVLINK_TYPES = {"NVL", "NVB"}
_NCCL_PCIE_TYPES = {"PIX", "PXB", "PXN", "P2C", "PHB", "SYS", "C2C"}


def _nccl_one(t: str, gpu_link: str | None) -> frozenset[str]:
    if t.startswith("P2P/MNNVL"):
        return frozenset({"nvlink"})
    if t.startswith("P2P/"):
        if gpu_link in _NCCL_NVLINK_TYPES:
            return frozenset({"nvlink"})
        if gpu_link in _NCCL_PCIE_TYPES:
            return frozenset({"pcie"})
        return frozenset({"nvlink", "pcie"})
    if t.startswith("SHM"):
        return frozenset({"shm"})
    if t.startswith("NET/Socket"):
        return frozenset({"tcp"})
    if re.match(r"NET/(IB|IBext|RoCE|AWS Libfabric|Libfabric|UCX)", t):
        # /GDRDMA: the NIC reads the GPU's memory; without it NCCL's proxy stages the bytes
        # through host memory (no GPUDirect RDMA)
        return frozenset({"rdma" if "/GDRDMA" in t else "rdma-host-staged"})
    return frozenset({"unknown"})


def classify_nccl(info: dict) -> LinkPath:
    detail = info.get("nccl") or {}
    transports = detail.get("transports")
    if transports is None:  # older records: only the joined path string
        path = str(info.get("path") or "")
        transports = [p.strip() for p in path.split(",") if "/" in p or p.strip() == "SHM"]
    gpu_link = detail.get("gpu_link")
    parts = tuple(_nccl_one(t, gpu_link) for t in transports)
    if not parts:
        return LinkPath(frozenset({"unknown"}), f"NCCL: {info.get('path') or 'no path recorded'}")
    ev = "NCCL " + ", ".join(transports) + (f" (GPU path type {gpu_link})" if gpu_link else "")
    kinds = frozenset().union(*parts)
    causes = (linkcauses.diagnose(Evidence("nccl", "cuda", kinds))
              if "rdma-host-staged" in kinds else ())
    return LinkPath(kinds, ev, parts, causes=causes)


# ---------------------------------------------------------------------------
# UCX (NIXL), MPI, Gloo

_UCX_KIND = [
    (re.compile(r"^(rc|dc|ud)(_mlx5|_verbs)?$|^ib$"), {"rdma"}),
    (re.compile(r"^(cma|knem|xpmem|posix|sysv)$"), {"shm"}),
    (re.compile(r"^tcp$"), {"tcp"}),
    (re.compile(r"^cuda_ipc$"), {"nvlink", "pcie"}),
    (re.compile(r"^(cuda_copy|gdr_copy|self)$"), {"host"}),
]
_STAGED = ("copy-in", "copy-out", "bcopy", "stag", "pipeline")  # a host bounce buffer's words


@lru_cache(maxsize=1024)  # (a pure function of a transport's name: a matrix asks per record)
def _ucx_kind(tl: str) -> frozenset[str]:
    return frozenset(next((k for rx, k in _UCX_KIND if rx.match(tl)), {"unknown"}))


def classify_ucx(path: str) -> LinkPath:
    """From the path string alone (records without UCX's rows): 'UCX RMA write: rc_mlx5/
    mlx5_0:1 (zero-copy); notifications (AM): tcp/lo': the RMA part is the KV's path; the
    notifications are a few bytes and do not count."""
    rma = ";".join(p for p in path.split(";") if "notifications" not in p and "other memory"
                   not in p)
    tls = re.findall(r"([a-z][a-z0-9_]*)/", rma.removeprefix("UCX"))
    parts = tuple(_ucx_kind(tl) for tl in tls)
    kinds = frozenset().union(*parts) if parts else frozenset({"unknown"})
    return LinkPath(kinds, path, parts, emulated="software emulation" in rma)


def _row_parts(row: dict, memory: str | None, same_gpu: str | None) -> list[frozenset[str]]:
    """The kinds of one KV row's lanes. On cuda memory an RDMA lane beside cuda_copy, or a
    copy-in protocol, reads a host bounce buffer: rdma-host-staged, not GPUDirect."""
    tls = [lane.split("/", 1)[0] for lane in ucx_rows.lanes(row)]
    net = [t for t in tls if "rdma" in _ucx_kind(t)]
    staged = memory == "cuda" and net and (
        "cuda_copy" in tls or any(w in row.get("protocol", "") for w in _STAGED))
    out = []
    for tl in tls:
        if staged and tl in net:
            out.append(frozenset({"rdma-host-staged"}))
        elif tl == "cuda_copy" and net:
            continue  # the staging copy beside the network lane, not a link of its own
        elif tl == "cuda_ipc" and same_gpu:
            out.append(frozenset({"same-device"}))
        else:
            out.append(_ucx_kind(tl))
    return out or [frozenset({"unknown"})]


def _ucx_from_rows(info: dict, rows: list[dict], memory: str | None, ctx: PairFacts) -> LinkPath:
    op = str(info.get("nixl_op") or ("read" if "RMA read" in str(info.get("path")) else "write"))
    split = ucx_rows.split_rows(rows, op, memory)
    if not split.kv:
        self_rows = [r for r in rows if re.search(r"\bself\b", r.get("endpoint", ""))
                     and r.get("operation", "").startswith(f"remote memory {op}")]
        causes = linkcauses.diagnose(Evidence("nixl", ctx.device, frozenset({"unknown"}),
                                              op=op, endpoints=("self",))) if self_rows else ()
        return LinkPath(frozenset({"unknown"}), f"UCX printed no {memory}->{memory} RMA {op} "
                        f"row to a peer ({info.get('path') or 'no path recorded'})",
                        causes=causes)
    parts = tuple(p for r in split.kv for p in _row_parts(r, memory, ctx.same_gpu))
    kinds = frozenset().union(*parts)
    emulated = any(r.get("protocol") == "software emulation" for r in split.kv)
    seen: list[str] = []
    for r in split.kv:
        what = f"{r['transport']} ({r['protocol']})"
        if what not in seen:
            seen.append(what)
    where = f" ({memory}->{memory}, the KV's memory)" if memory else ""
    evidence = f"UCX RMA {op}{where}: {', '.join(seen)}"
    if ctx.same_gpu and "same-device" in kinds:
        evidence += f"; both ranks on one GPU: {ctx.same_gpu}"
    ucx_env = info.get("ucx_env") if isinstance(info.get("ucx_env"), dict) else {}
    ev = Evidence("nixl", ctx.device, kinds, emulated, op,
                  tuple(dict.fromkeys(lane.split("/", 1)[0] for r in split.kv
                                      for lane in ucx_rows.lanes(r))),
                  tuple(sorted({m[0] for r in (*split.kv, *split.other, *split.notifications)
                                if (m := re.search(r"\b(intra-node|inter-node|self)\b",
                                                   r.get("endpoint", "")))})),
                  ucx_env, ctx.rank_vars, ctx.same_host, ctx.same_gpu, ctx.pids, ctx.pid_ns)
    tls = ucx_env.get("UCX_TLS") if isinstance(ucx_env.get("UCX_TLS"), str) else None
    return LinkPath(kinds, evidence, parts, emulated, linkcauses.diagnose(ev), tls)


def classify_ucx_info(info: dict, ctx: PairFacts | None = None) -> LinkPath:
    """UCX's path (NIXL's records): from UCX's own protocol rows where the record has them
    (the KV's rows between its memory on both sides), else from the path string alone."""
    ctx = ctx or PairFacts()
    rows = info.get("ucx_protocols")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        return _ucx_from_rows(info, rows, ctx.memory, ctx)
    return classify_ucx(str(info.get("path") or ""))


def by_path(info: dict | None, ctx: PairFacts | None = None) -> LinkPath:
    """The rules for a record whose transport declares no link of its own (a transport this
    install does not have, or one that says nothing more): its path's own words, UCX's
    protocols or TCP sockets, else unknown."""
    info = info or {}
    path = str(info.get("path") or "")
    if path.startswith("UCX"):
        return classify_ucx_info(info, ctx)
    if path.startswith("TCP"):
        return LinkPath(frozenset({"tcp"}), path)
    return LinkPath(frozenset({"unknown"}), path or "no path recorded")


LinkRule = Callable[[dict, PairFacts], LinkPath]


def classify_record(rec, rules: Mapping[str, LinkRule] | None = None) -> LinkPath:
    """The link a record's bytes took: the rule its transport declares (`rules`: transport
    name -> its link_path; kvbench.p2p.transports.classify_record passes every installed
    transport's), else `by_path`, with the record's own facts (where the KV lived, the pair's
    hosts, GPUs, processes and variables; `rec` is a record dict or anything with `get`)."""
    rule = (rules or {}).get(str(rec.get("transport") or ""), by_path)
    return rule(rec.get("transport_info") or {}, pair_facts(rec))


def mismatch(records: Iterable[dict], expect: str,
             rules: Mapping[str, LinkRule] | None = None) -> str | None:
    """One line for the fit's `link_mismatch` warning when some records' bytes did not (or
    cannot be shown to) go over the expected kind of link; None when all agree."""
    return mismatch_of(Counter(classify_record(rec, rules) for rec in records), expect)


def mismatch_of(paths: Mapping[LinkPath, int], expect: str) -> str | None:
    """mismatch() from records already classified: LinkPath -> number of records. Each path
    that is not the link says why, where the records tell (kvbench.links.linkcauses)."""
    bad: dict[str, int] = {}
    for lp, count in paths.items():
        if lp.fails(expect):
            emu = ", software emulation" if lp.emulated else ""
            why = lp.explain(expect)
            key = f"{lp.evidence} ({lp.label}{emu})" + (f" -- {why}" if why else "")
            bad[key] = bad.get(key, 0) + count
    if not bad:
        return None
    n = sum(bad.values())
    said = "; ".join(f"{k} in {v}" for k, v in bad.items())
    return (f"expected the bytes on {expect}, but {n} of {sum(paths.values())} record(s) say "
            f"otherwise: {said}")


def emulation_note(paths: Iterable[LinkPath]) -> str | None:
    """One line when some KV path was UCX's software emulation (p2p prints it at the end of a
    run, with or without --expect-link); None otherwise."""
    seen: list[LinkPath] = []
    for lp in paths:
        if lp.emulated and lp not in seen:
            seen.append(lp)
    if not seen:
        return None
    return ("the KV's path is UCX's software emulation, not a link: "
            + "; ".join(f"{lp.evidence} -- {lp.explain()}" for lp in seen))


def declared(name: str) -> tuple[str, float]:
    """(kind, line rate GB/s) of a declared link name; ValueError names the known ones."""
    try:
        kind, gbps, _ = DECLARED_LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link {name!r}; declared links: {', '.join(DECLARED_LINKS)}") from None
    return kind, gbps


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvbench.links.linkpath declared NAME` prints 'KIND GBPS' (for the job scripts);
    `python -m kvbench.links.linkpath links` lists the declared links."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "kvbench linkpath"
    if argv == ["links"]:
        for name, (kind, gbps, what) in DECLARED_LINKS.items():
            print(f"{name:<10} {kind:<7} {gbps:>7g} GB/s  {what}")
        return 0
    if len(argv) == 2 and argv[0] == "declared":
        try:
            kind, gbps = declared(argv[1])
        except ValueError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        print(f"{kind} {gbps:g}")
        return 0
    print(f"usage: {prog} links | declared NAME", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
