"""Mooncake's own benchmark, `transfer_engine_bench` (shipped in the wheel), between the same
two ranks on the same bytes, entry size and protocol: the yardstick of `--baseline` with
`--transport mooncake` (kvbench's GB/s over the benchmark's, as the MPI baseline prints).

The target runs on the rank kvbench's transfer targets (decode for WRITE, prefill for READ),
the initiator on the other. The benchmark submits batches of `batch_size` entries of
`block_size` bytes from one thread for `duration` seconds and reports its throughput; here a
batch is one handoff's entries (capped at --mooncake-inflight, the TCP transport's per-peer
queue, as kvbench caps what it has in flight) and an entry is one of kvbench's messages.
Every address is given explicitly (P2PHANDSHAKE, 127.0.0.1 or the rank's own address): the
benchmark's built-in defaults name a metadata server and a segment on a private network.
The target is stopped by its PID on every path.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from pathlib import Path

from kvbench.p2p.transports.mooncake import libs

KIND = "transfer_engine_bench"
_TAG = 7900
_LISTEN = re.compile(r"listening on (\S+:\d+)")
_THROUGHPUT = re.compile(r"throughput ([\d.]+) GB/s")
_MAX_BUFFER = 1 << 31  # the benchmark's buffer (per process): the handoff, at most 2 GiB


def plan(nbytes: int, entries: int | None, inflight: int) -> tuple[int, int, int]:
    """(block_size, batch_size, buffer_size) for the benchmark: kvbench's entry size, one
    handoff's entries per batch (at most `inflight`), a buffer holding one batch."""
    entries = max(1, entries or 1)
    block = max(1, nbytes // entries)
    batch = max(1, min(entries, inflight, _MAX_BUFFER // block))
    return block, batch, block * batch


def _common(host: str, protocol: str, devices: str, buffer: int) -> list[str]:
    exe = libs.executable("transfer_engine_bench")
    return [str(exe), "--metadata_server=P2PHANDSHAKE", f"--local_server_name={host}",
            f"--protocol={protocol}", f"--device_name={devices}", f"--buffer_size={buffer}",
            "--auto_discovery=false"]


def _env() -> dict[str, str]:
    """The benchmark's environment: the private libraries, and its INFO lines on (the
    target's port and the initiator's throughput are INFO lines)."""
    return {**libs.exe_env(), "GLOG_minloglevel": "0", "MC_LOG_LEVEL": "INFO"}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _target(comm, peer: int, host: str, cmd: list[str], timeout: float) -> str | None:
    """Start the target, tell the initiator its segment, wait for the initiator's end."""
    with tempfile.NamedTemporaryFile("w+", prefix="kvbench-teb-target-", suffix=".log") as log:
        proc = subprocess.Popen([*cmd, "--mode=target"], stdout=log, stderr=subprocess.STDOUT,
                                env=_env(), preexec_fn=libs.die_with_parent)
        try:
            seg, deadline = None, time.perf_counter() + timeout
            while seg is None and proc.poll() is None and time.perf_counter() < deadline:
                m = _LISTEN.search(Path(log.name).read_text(errors="replace"))
                seg = m[1] if m else time.sleep(0.05)
            why = None if seg else f"the target did not start ({_last(log.name)})"
            comm.send((seg, why), dest=peer, tag=_TAG)
            if seg is None:
                return why
            req = comm.irecv(source=peer, tag=_TAG + 1)
            deadline = time.perf_counter() + timeout
            while True:
                done, _ = req.test()
                if done or time.perf_counter() > deadline:
                    break
                time.sleep(0.05)
            if not done:
                req.Cancel()
                return "the initiator did not finish before its limit"
            return None
        finally:
            _stop(proc)


def _initiator(comm, peer: int, cmd: list[str], op: str, block: int, batch: int,
               duration: int, timeout: float) -> tuple[float | None, str | None]:
    seg, why = comm.recv(source=peer, tag=_TAG)
    if seg is None:
        return None, why
    args = [*cmd, "--mode=initiator", f"--segment_id={seg}", f"--operation={op}",
            f"--block_size={block}", f"--batch_size={batch}", "--threads=1",
            f"--duration={duration}", "--report_unit=GB"]
    try:
        got = subprocess.run(args, capture_output=True, text=True, env=_env(),
                             timeout=duration + timeout)
        m = _THROUGHPUT.search(got.stdout + got.stderr)
        if got.returncode != 0 or not m:
            tail = (got.stdout + got.stderr).strip().splitlines()[-1:] or ["no output"]
            return None, f"transfer_engine_bench exited {got.returncode}: {tail[0][:200]}"
        return float(m[1]), None
    except subprocess.TimeoutExpired:
        return None, f"transfer_engine_bench ran past {duration + timeout:.0f} s"
    finally:
        comm.send(True, dest=peer, tag=_TAG + 1)


def _last(path: str) -> str:
    lines = Path(path).read_text(errors="replace").strip().splitlines()
    return lines[-1][:200] if lines else "no output"


def bench_gbps(comm, host: str, op: str, protocol: str, devices: str, nbytes: int,
               entries: int | None, inflight: int, duration: int, timeout: float
               ) -> tuple[float | None, str | None]:
    """(the benchmark's GB/s, why there is none) on rank 0; (None, None) elsewhere.
    Collective over ranks 0 and 1 (the others return at once)."""
    rank = comm.Get_rank()
    if rank > 1:
        return None, None
    block, batch, buffer = plan(nbytes, entries, inflight)
    cmd = _common(host, protocol, devices, buffer)
    initiator = 0 if op == "write" else 1
    if rank == initiator:
        out = _initiator(comm, 1 - rank, cmd, op, block, batch, duration, timeout)
    else:
        out = (None, _target(comm, 1 - rank, host, cmd, timeout))
    if initiator == 1:  # rank 0 reports: the initiator's figure travels to it
        if rank == 1:
            comm.send(out, dest=0, tag=_TAG + 2)
            return None, None
        target_why = out[1]
        gbps, why = comm.recv(source=1, tag=_TAG + 2)
        return gbps, why or target_why
    return out if rank == 0 else (None, None)
