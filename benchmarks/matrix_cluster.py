#!/usr/bin/env python3
"""Ground truth for `kvbench matrix`: a real Slurm cluster whose nodes are network namespaces,
one pair shaped to a known rate and one pair routed over another interface, and the matrix
must name exactly those two.

    sudo .venv/bin/python benchmarks/matrix_cluster.py                 # 3 nodes, 400mbit
    sudo .venv/bin/python benchmarks/matrix_cluster.py --nodes 4 --rate 200mbit --out DIR

What it builds (scripts/slurm-cluster with KVBENCH_SLURM_NETNS=1): nodes n1..nN, each its own
network namespace and host name, on one bridge (10.213.0.k/24 on eth0, MTU 9000), slurmctld in
a namespace of its own. Then, in the nodes' namespaces only:

  shaped pair    n2 -> n1: on n2's eth0 an HTB root sends what is addressed to n1 (u32 match
                 on 10.213.0.1) to a class whose leaf is a token bucket (`tbf rate R`); all
                 other traffic leaves unclassified, unshaped. The pair's payload rate is R x
                 MSS / (MSS + 66) / 8 (66 bytes of Ethernet, IPv4 and TCP-with-timestamps
                 headers per segment; the ACKs go the other way, through no shaper).
  odd-path pair  n1 -> n3: a second veth links n1 and n3 (eth1; n1 has 10.214.0.1/24 on it,
                 n3 no address) and n1 routes n3's address over it (`10.213.0.3 dev eth1`), a
                 stale host route. UCX's TCP transport (UCX_TLS=tcp) checks which interface
                 the route leaves by, so n1's endpoint to n3 runs on tcp/eth1 while every other
                 endpoint runs on tcp/eth0. n3 reaches n1's eth1 address through n1's eth0
                 (`10.214.0.1 via 10.213.0.1 dev eth0`), so n3 -> n1 stays on eth0: one
                 ordered pair is odd, not the pair of nodes.

It submits jobs/matrix.sbatch (`sbatch -N nodes`, one rank per node, `srun --mpi=pmix`,
kvbench matrix with --transport nixl on CPU memory, --expect-link tcp), waits for it, and
judges the matrix document: PASS when the pairs named are exactly the shaped one (finding
`slow`, its fitted rate within --tolerance of the payload rate) and the odd-path one (finding
`path_differs`, its path on eth1), and the job ended COMPLETED. The cluster, its daemons and
every namespace (and with them the qdiscs and routes) are removed afterwards, also on errors,
timeouts and Ctrl-C.

Exit status: 0 PASS, 1 FAIL (or the run failed), 2 bad arguments, 77 cannot run here (not
root, no ip/tc/nsenter, Slurm not installable): the line starting with SKIP says why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXIT_SKIP = 77
ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLUSTER = ROOT / "scripts" / "slurm-cluster"
EXIT_CANNOT_INSTALL = 3
HEADER_BYTES = 14 + 20 + 32  # Ethernet, IPv4, TCP with timestamps
SHAPED, ODD = (1, 0), (0, 2)  # n2 -> n1, n1 -> n3 (ranks: one per node, in node order)

sys.path.insert(0, str(ROOT))
from benchmarks.shaped_link import rate_bits, script_cli  # noqa: E402  (tc's rate syntax)
from kvbench.cli import ArgumentParser, UsageError  # noqa: E402
from kvbench.units import parse_bytes  # noqa: E402


def payload_gb_s(bits: float, mtu: int) -> float:
    """What the token bucket leaves for TCP payload: full segments of MTU - 52 bytes, each
    counted with HEADER_BYTES of headers (decimal GB/s)."""
    mss = mtu - 20 - 32
    return bits / 8 / 1e9 * mss / (mss + HEADER_BYTES)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="matrix_cluster.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="Slurm nodes, one rank each (3..8, "
                   "default 3)")
    p.add_argument("--rate", default="400mbit", help="tbf rate of the shaped pair, tc syntax "
                   "(default 400mbit = 0.05 GB/s)")
    p.add_argument("--bytes", default="1M,2M,4M,8M,16M,32M",
                   help="payload sizes (default 1M,2M,4M,8M,16M,32M)")
    p.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--mtu", type=int, default=9000, help="MTU of every link (default 9000)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="allowed relative error of the shaped pair's rate (default 0.10)")
    p.add_argument("--out", default=None, help="folder for the job's records, matrix, log and "
                   "summary (default results/scratch/matrix-cluster-<stamp>)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the job (default 600)")
    return p


def skip_reason() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root: network namespaces, tc, and Slurm's daemons"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (iproute2, util-linux)"
    return netns_support()


def netns_support() -> str | None:
    """Why this kernel cannot build the test network (namespaces, a bridge, veth, an HTB root
    with a u32 filter and a tbf leaf), tried on two throwaway namespaces; None: it can."""
    a, b = f"kvbm-probe-{os.getpid()}-a", f"kvbm-probe-{os.getpid()}-b"
    steps = [("ip", "netns", "add", a), ("ip", "netns", "add", b),
             ("ip", "-n", a, "link", "add", "br0", "type", "bridge"),
             ("ip", "link", "add", "v0", "netns", a, "type", "veth", "peer", "name", "v0",
              "netns", b),
             ("ip", "netns", "exec", b, "tc", "qdisc", "add", "dev", "v0", "root", "handle", "1:",
              "htb"),
             ("ip", "netns", "exec", b, "tc", "class", "add", "dev", "v0", "parent", "1:",
              "classid", "1:10", "htb", "rate", "1gbit"),
             ("ip", "netns", "exec", b, "tc", "qdisc", "add", "dev", "v0", "parent", "1:10",
              "tbf", "rate", "400mbit", "burst", "32kb", "latency", "200ms"),
             ("ip", "netns", "exec", b, "tc", "filter", "add", "dev", "v0", "parent", "1:",
              "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst", "10.0.0.1/32",
              "flowid", "1:10")]
    try:
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                return f"this kernel cannot build the test network: {' '.join(cmd[:6])} ...: " \
                       f"{r.stderr.strip()}"
        return None
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def sh(*cmd: str, check: bool = True, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=ROOT)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


class Cluster:
    """scripts/slurm-cluster in netns mode, in a folder of its own."""

    def __init__(self, d: Path, nodes: int, mtu: int):
        self.dir = d
        self.env = {**os.environ, "KVBENCH_SLURM_NETNS": "1", "KVBENCH_SLURM_NODES": str(nodes),
                    "KVBENCH_SLURM_MTU": str(mtu)}

    def up(self) -> str | None:
        """None when up; the reason when Slurm cannot be installed here (a skip)."""
        r = sh(str(CLUSTER), "up", str(self.dir), check=False, env=self.env, timeout=1200)
        if r.returncode == 0:
            return None
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        if r.returncode == EXIT_CANNOT_INSTALL:
            return last
        raise RuntimeError(f"scripts/slurm-cluster up failed (exit {r.returncode}):\n{r.stderr}")

    def down(self) -> str:
        r = sh(str(CLUSTER), "down", str(self.dir), check=False, env=self.env, timeout=300)
        return r.stderr

    def ns(self, node: str) -> str:
        return sh(str(CLUSTER), "netns", str(self.dir), node).stdout.strip()

    def client(self, *cmd: str, env=None) -> subprocess.CompletedProcess:
        return sh(str(CLUSTER), "exec", str(self.dir), *cmd, check=False,
                  env={**self.env, **(env or {})})

    def namespaces(self) -> list[str]:
        pre = (self.dir / "netns").read_text().strip() if (self.dir / "netns").exists() else None
        listed = sh("ip", "netns", "list").stdout.split()
        return [n for n in listed if pre and n.startswith(pre + "-")]


def plant(c: Cluster, bits: float) -> dict:
    """The shaped pair and the odd-path pair (module doc); returns what was set, as tc and
    ip print it."""
    n1, n2, n3 = c.ns("n1"), c.ns("n2"), c.ns("n3")
    rate = f"{bits / 1e6:g}mbit"
    # n2 -> n1 shaped: classify by destination, shape the class with a token bucket
    sh("ip", "netns", "exec", n2, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
       "htb")  # unclassified traffic is sent directly, unshaped
    sh("ip", "netns", "exec", n2, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid",
       "1:10", "htb", "rate", "100gbit")
    sh("ip", "netns", "exec", n2, "tc", "qdisc", "add", "dev", "eth0", "parent", "1:10", "handle",
       "10:", "tbf", "rate", rate, "burst", "32kb", "latency", "200ms")
    sh("ip", "netns", "exec", n2, "tc", "filter", "add", "dev", "eth0", "parent", "1:",
       "protocol", "ip", "prio", "1", "u32", "match", "ip", "dst", "10.213.0.1/32",
       "flowid", "1:10")
    # n1 -> n3 over a second link: n1 routes n3's address through eth1
    mtu = str(c.env["KVBENCH_SLURM_MTU"])
    sh("ip", "link", "add", "eth1", "netns", n1, "type", "veth", "peer", "name", "eth1",
       "netns", n3)
    for ns in (n1, n3):
        sh("ip", "-n", ns, "link", "set", "eth1", "mtu", mtu, "up")
        for conf in ("all", "default", "eth0", "eth1"):  # asymmetric routes: no reverse-path drop
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0")
    sh("ip", "-n", n1, "addr", "add", "10.214.0.1/24", "dev", "eth1")
    sh("ip", "-n", n1, "route", "add", "10.213.0.3/32", "dev", "eth1")
    # n3 reaches n1's eth1 address over its own eth0, through n1: whichever of n1's addresses
    # UCX gives n3 (a wire-up request carries the lane's own), n3 has a route from its one
    # device to it, and n3 -> n1 stays on eth0
    sh("ip", "-n", n3, "route", "add", "10.214.0.1/32", "via", "10.213.0.1", "dev", "eth0")
    return {"qdisc_n2": sh("ip", "netns", "exec", n2, "tc", "qdisc", "show", "dev", "eth0").stdout,
            "filter_n2": sh("ip", "netns", "exec", n2, "tc", "filter", "show", "dev", "eth0").stdout,
            "route_n1_to_n3": sh("ip", "-n", n1, "route", "get", "10.213.0.3").stdout.strip(),
            "route_n3_to_n1": sh("ip", "-n", n3, "route", "get", "10.213.0.1").stdout.strip(),
            "route_n3_to_n1_eth1": sh("ip", "-n", n3, "route", "get", "10.214.0.1").stdout.strip()}


def submit(c: Cluster, args, out_root: Path, log: Path) -> str:
    env = {"KVBENCH_PY": PY, "KVBENCH_OUT_ROOT": str(out_root), "KVBENCH_DEVICE": "cpu",
           "KVBENCH_TRANSPORTS": "nixl", "KVBENCH_BYTES": args.bytes, "KVBENCH_LINK": "eth-10g",
           "UCX_TLS": "tcp",  # data over TCP: UCX would otherwise move it by shared memory,
           # since every namespace shares this host's memory
           "KVBENCH_P2P_ARGS": f"--iters {args.iters} --min-iters {args.iters} --warmup 1 "
                               "--seconds-per-point 30 --timeout 120"}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "KVBENCH_"))},
           **env}
    r = c.client("sbatch", "--parsable", "-N", str(args.nodes), "--ntasks-per-node=1",
                 "-o", str(log), "jobs/matrix.sbatch", env=env)
    if r.returncode != 0:
        raise RuntimeError(f"sbatch refused jobs/matrix.sbatch: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def wait(c: Cluster, job: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = dict(re.findall(r"(\w+)=(\S*)", c.client("scontrol", "show", "job", "-o", job).stdout))
        if st.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return st
        if time.monotonic() > deadline:
            c.client("scancel", job)
            raise RuntimeError(f"job {job} still {st.get('JobState')} after {timeout:g} s")
        time.sleep(1)


def judge(doc: dict, expected_gb_s: float, tolerance: float) -> dict:
    """Named exactly the planted pairs, for the planted reasons, the rate within tolerance."""
    named = {tuple(p["pair"]): sorted(f["code"] for f in p["findings"]) for p in doc["pairs"]
             if p["findings"]}
    shaped = next(p for p in doc["pairs"] if tuple(p["pair"]) == SHAPED)
    odd = next(p for p in doc["pairs"] if tuple(p["pair"]) == ODD)
    rate = shaped["effective_gb_s"]
    err = None if rate is None else rate / expected_gb_s - 1
    checks = {
        "named_exactly_the_planted_pairs": named == {SHAPED: ["slow"], ODD: ["path_differs"]},
        "shaped_rate_within_tolerance": err is not None and abs(err) <= tolerance,
        "odd_pair_path_names_eth1": "tcp/eth1" in odd["path"],
        "other_pairs_on_eth0": all("tcp/eth0" in p["path"] and "eth1" not in p["path"]
                                   for p in doc["pairs"] if tuple(p["pair"]) != ODD),
    }
    return {"named": {f"{k[0]},{k[1]}": v for k, v in named.items()}, "shaped_gb_s": rate,
            "shaped_gb_s_ci95": shaped["effective_gb_s_ci95"], "expected_gb_s": expected_gb_s,
            "relative_error": err, "odd_path": odd["path"], "checks": checks,
            "pass": all(checks.values())}


def _terminate(signum, frame):  # SIGTERM (a CI timeout): unwind so everything is removed
    raise SystemExit(128 + signum)


def run(args, out: Path) -> int:
    bits = rate_bits(args.rate)
    expected = payload_gb_s(bits, args.mtu)
    work = Path(tempfile.mkdtemp(prefix="kvbench-matrix-cluster-"))
    c = Cluster(work / "cluster", args.nodes, args.mtu)
    (work / "cluster").mkdir()
    load_before = os.getloadavg()
    try:
        why = c.up()
        if why:
            print(f"SKIP: cannot install Slurm here: {why}")
            return EXIT_SKIP
        planted = plant(c, bits)
        log = out / "job.out"
        t0 = time.monotonic()
        job = submit(c, args, out, log)
        st = wait(c, job, args.timeout)
        job_s = time.monotonic() - t0
    finally:
        down = c.down()
        left = c.namespaces() if (work / "cluster" / "netns").exists() else []
        shutil.rmtree(work, ignore_errors=True)
    if left:
        raise RuntimeError(f"namespaces left after down: {left}\n{down}")
    text = log.read_text() if log.exists() else ""
    docs = sorted(out.glob("*/kvbench-matrix-*.json"))
    if st.get("JobState") != "COMPLETED" or len(docs) != 1:
        print(text[-4000:])
        raise RuntimeError(f"job {job}: {st.get('JobState')} exit {st.get('ExitCode')}, "
                           f"{len(docs)} matrix document(s)")
    doc = json.loads(docs[0].read_text())
    verdict = judge(doc, expected, args.tolerance)
    summary = {"schema": "kvbench.matrix-cluster/1", "nodes": args.nodes, "rate": args.rate,
               "mtu": args.mtu, "bytes": args.bytes, "iters": args.iters,
               "tolerance": args.tolerance, "job": job, "job_state": st.get("JobState"),
               "exit_code": st.get("ExitCode"), "job_seconds": round(job_s, 1),
               "load_average_before": load_before, "load_average_after": os.getloadavg(),
               "planted": planted, "matrix": str(docs[0]), **verdict}
    (docs[0].parent / "matrix-cluster-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{'PASS' if verdict['pass'] else 'FAIL'}: named {verdict['named']}; shaped pair "
          f"{SHAPED[0]}->{SHAPED[1]} {verdict['shaped_gb_s']} GB/s vs payload rate "
          f"{expected:.5g} GB/s ({args.rate}, MTU {args.mtu}): error "
          f"{'n/a' if verdict['relative_error'] is None else format(100 * verdict['relative_error'], '+.2f')}"
          f"% (tolerance {100 * args.tolerance:g}%); odd pair {ODD[0]}->{ODD[1]} path "
          f"{verdict['odd_path']!r}; job {job} {st.get('JobState')} in {job_s:.0f} s")
    return 0 if verdict["pass"] else 1


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    args = build_parser().parse_args(argv)
    rate_bits(args.rate)
    try:
        [parse_bytes(s) for s in args.bytes.split(",")]
    except ValueError as exc:
        raise UsageError(f"--bytes: {exc}") from None
    if not 3 <= args.nodes <= 8:
        raise UsageError("--nodes must be 3..8 (the plant uses n1, n2 and n3)")
    if not 1280 <= args.mtu <= 65535:
        raise UsageError("--mtu must be 1280..65535")
    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return EXIT_SKIP
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out) if args.out else ROOT / "results" / "scratch" / f"matrix-cluster-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    return run(args, out.resolve())


def cli(argv=None) -> int:
    return script_cli("matrix_cluster.py", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
