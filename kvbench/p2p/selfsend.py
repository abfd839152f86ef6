"""`python -m kvbench.p2p.selfsend`: a world of one rank sends to itself through NCCL.

On a machine with one GPU NCCL cannot put two ranks on the device, but one rank can post a
send and a receive to itself in one `batch_isend_irecv` group: the same batched path
kvbench's NCCL transport takes, on a communicator bound with `device_id` (eager). That shows
this torch's and this NCCL's P2P behaviour (it runs, the bytes arrive, the versions) before a
multi-GPU job is tried. Prints one JSON line; exit 0 when every byte arrived, 1 otherwise.

    python -m kvbench.p2p.selfsend [--backend nccl] [--bytes 64M] [--iters 5]
"""

from __future__ import annotations

import json
import socket
import sys
import time

from kvbench.cli import ArgumentParser, arg_int


def exchange(dist, send, recv) -> None:
    """One group: a send to rank 0 and a receive from rank 0 (this rank), completed."""
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 0),
                                    dist.P2POp(dist.irecv, recv, 0)])
    for w in works or ():
        w.wait()


def check(dist, send, recv, iters: int, sync) -> dict:
    """Exchange `iters` times; the bytes that differ after the last one, and the times."""
    times = []
    for _ in range(iters):
        recv.zero_()
        sync()
        t0 = time.perf_counter()
        exchange(dist, send, recv)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    wrong = int((recv != send).sum())
    return {"wrong_bytes": wrong, "ms": times, "ok": wrong == 0}


def run(backend: str, nbytes: int, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    cuda = backend == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {"device_id": dev} if cuda else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, **kwargs)
    try:
        send = torch.arange(nbytes, device=dev, dtype=torch.int64).remainder(251).to(torch.uint8)
        recv = torch.zeros_like(send)
        out = check(dist, send, recv, iters, torch.cuda.synchronize if cuda else (lambda: None))
    finally:
        dist.destroy_process_group()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    return {"backend": backend, "bytes": nbytes, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl,
            "gpu": torch.cuda.get_device_name(dev) if cuda else None, **out}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m kvbench.p2p.selfsend", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--bytes", type=arg_int(1, 1 << 40), default=64 << 20,
                   help="payload in bytes (default 64 MiB)")
    p.add_argument("--iters", type=arg_int(1, 10_000), default=5)
    args = p.parse_args(argv)
    try:
        res = run(args.backend, args.bytes, args.iters)
    except Exception as exc:  # noqa: BLE001 - reported as one line, the JSON says why
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        res = {"backend": args.backend, "bytes": args.bytes, "ok": False, "error": first[:400]}
        print(json.dumps(res))
        print(f"selfsend: error: {first[:400]}", file=sys.stderr)
        return 1
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
