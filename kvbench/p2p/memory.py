"""Memory planning before anything is allocated: whether every size's data fits at once
(`--order rounds`), only one size at a time (`blocks`, said in one line), or not at all
(refused), per memory domain: a host's RAM, or on CUDA a GPU."""

from __future__ import annotations

from kvbench.p2p.devices import mem_available_bytes
from kvbench.units import GB


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
