"""`kvbench faults PLAN.yaml`: break the KV handoff on purpose and audit every request.

For each kv_load_failure_policy (fail, recompute) the disaggregated deployment is started
fresh, a clean reference run records each prompt's greedy tokens, then each injection
runs a small open-loop workload whose first request is held by the P/D proxy between
"prefill answered with kv_transfer_params" and "decode is asked", where the fault goes in:

  side_channel  decode is handed params naming an engine whose side channel does not
                answer (a closed port in the lab's block, an engine id never seen): the
                NIXL handshake fails;
  stop_prefill  the prefill instance is SIGSTOPped, decode is released, and prefill stays
                stopped for longer than its KV lease (kv_lease_s) before SIGCONT;
  kill_prefill  the prefill instance is SIGKILLed (its whole process group), then decode
                is released; later requests find no prefill at all.

Then the deployment drains and kvbench.lab.faults.audit judges the requests and the instances.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from kvbench.cli import ArgumentParser, UsageError, arg_int
from kvbench.lab.faults import audit
from kvbench.lab.load.snapshot import fetch
from kvbench.lab.stack import deploy
from kvbench.lab.stack import env as labenv
from kvbench.lab.stack.procs import LabState, run_interruptible, stop, stop_on_exit
from kvbench.records.schema.lab import SCHEMA_FAULTS, FaultsReport
from kvbench.records.write import as_contract, utc_stamp, write_new_file

INJECTIONS = ("side_channel", "stop_prefill", "kill_prefill")
POLICIES = ("fail", "recompute")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def workload(n: int, prompt_words: int, max_tokens: int, spacing_s: float, tag: str) -> list[dict]:
    """n distinct prompts (index-dependent word order), sent spacing_s apart."""
    reqs = []
    for i in range(n):
        words = [WORDS[(i * 5 + k * (i + 3)) % len(WORDS)] for k in range(prompt_words)]
        reqs.append({"id": f"{tag}-{i}", "index": i, "model": deploy.SERVED_NAME,
                     "prompt": " ".join(words), "max_tokens": max_tokens, "send_at_s": i * spacing_s})
    return reqs


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read()
    return json.loads(text) if text.strip() else {}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def run_client(endpoint: str, reqs: list[dict], out: Path, deadline_s: float) -> subprocess.Popen:
    """Start the streaming client (lab venv) on reqs; the caller waits for it."""
    spec = out.with_suffix(".requests.json")
    spec.write_text(json.dumps(reqs))
    env = dict(os.environ, PYTHONPATH=str(deploy.REPO_ROOT))
    return subprocess.Popen(client_cmd(spec, endpoint, out, deadline_s), env=env)


def client_cmd(spec: Path, endpoint: str, out: Path, deadline_s: float) -> list[str]:
    return [str(labenv.lab_python()), "-m", "kvbench.lab.venv.client", str(spec),
            "--endpoint", endpoint, "--out", str(out), "--deadline-s", str(deadline_s)]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def wait_held(proxy: str, timeout_s: float = 60.0) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        held = _get(proxy + "/kvbench/held")
        if held:
            return held
        time.sleep(0.05)
    raise RuntimeError("no request was held by the proxy (did prefill answer?)")


class FaultRun:
    """One deployment (one policy): reference run, then the injections, each audited."""

    def __init__(self, st: LabState, cfg, out: Path, n: int, deadline_s: float):
        self.st, self.cfg, self.out, self.n, self.deadline_s = st, cfg, out, n, deadline_s
        self.proxy = st.endpoint
        self.prefill = st.by_role("prefill")[0]
        self.roles = {s.role: deploy.url(s.port) for s in st.services if s.role != "proxy"}
        self.references: dict[int, list[int]] = {}

    def reset_caches(self) -> None:
        for base in self.roles.values():
            try:
                _post(base + "/reset_prefix_cache", {})
            except OSError:
                pass  # a killed prefill has no cache to reset

    def snapshot(self) -> dict:
        """Metrics of every live instance, after a probe request to each.

        vLLM publishes connector stats (failed transfers, expired leases) with the next
        engine step, so an idle engine can hold back counts for an unbounded time. A
        one-token probe sent straight to each instance forces that step; its prompt
        tokens are recorded so the recompute count can leave them out.
        """
        out = {}
        for role, base in self.roles.items():
            probe = 0
            try:
                probe = _post(base + "/v1/completions", {"model": deploy.SERVED_NAME, "prompt": "probe",
                                                         "max_tokens": 1})["usage"]["prompt_tokens"]
            except (OSError, KeyError):
                pass  # a killed instance answers nothing; fetch records the gap
            time.sleep(0.3)
            snap = fetch(base + "/metrics")
            if snap is not None:
                snap["probe_prompt_tokens"] = probe
            out[role] = snap
        return out

    def reference(self) -> None:
        reqs = workload(self.n, 60, 16, 0.2, "ref")
        path = self.out / "reference.jsonl"
        run_client(self.proxy, reqs, path, self.deadline_s).wait()
        for rec, req in zip(read_jsonl(path), reqs, strict=True):
            self.references[req["index"]] = [t for c in rec["chunks"] for t in c.get("token_ids") or []]

    def inject(self, name: str) -> None:
        held = wait_held(self.proxy)
        rid = next(iter(held))
        if name == "side_channel":
            patch = {"remote_engine_id": f"kvbench-unreachable-{rid}", "remote_port": self.cfg.port(299)}
            _post(self.proxy + "/kvbench/release", {"id": rid, "patch": patch})
        elif name == "stop_prefill":
            self.prefill.signal(signal.SIGSTOP)
            _post(self.proxy + "/kvbench/release", {"id": rid})
            time.sleep(self.cfg.kv_lease_s + 5)
            self.prefill.signal(signal.SIGCONT)
        else:
            stop(self.prefill, grace_s=0.0)
            _post(self.proxy + "/kvbench/release", {"id": rid})

    def drain(self, idle: dict, killed: bool) -> dict:
        """Poll until both instances are idle again, or the lease plus a margin has passed."""
        t0 = time.monotonic()
        while True:
            snap = {role: fetch(base + "/metrics") for role, base in self.roles.items()}
            quiet = all(s is not None and s.get("num_requests_running", 0) == 0
                        and s.get("num_requests_waiting", 0) == 0
                        and s.get("kv_cache_usage_perc", 0) <= (idle.get(r) or {}).get("kv_cache_usage_perc", 0)
                        for r, s in snap.items() if not (killed and r == "prefill"))
            if (quiet and time.monotonic() - t0 > self.cfg.kv_lease_s + 3) or \
                    time.monotonic() - t0 > self.cfg.kv_lease_s + 20:
                return self.snapshot()
            time.sleep(1.0)

    def scenario(self, name: str) -> dict:
        self.reset_caches()
        idle = self.snapshot()
        _post(self.proxy + "/kvbench/hold", {"count": 1})
        reqs = workload(self.n, 60, 16, 0.5, name)
        chunks = self.out / f"{name}.chunks.jsonl"
        t0 = time.time()
        client = run_client(self.proxy, reqs, chunks, self.deadline_s)
        try:
            self.inject(name)
        finally:
            client.wait()
        after = self.drain(idle, killed=name == "kill_prefill")
        return self.judge(name, reqs, read_jsonl(chunks), idle, after, t0)

    def judge(self, name, reqs, records, idle, after, t0) -> dict:
        events = [e for e in read_jsonl(Path(self.st.by_role("proxy")[0].extra["events"]))
                  if e["t"] >= t0 - 1 and any(e["id"] == r["id"] for r in reqs)]
        attempts = audit.attempts_from_events(events)
        prefill_ok = sum(1 for e in events if e["step"] == "prefill_done" and e.get("status") == 200)
        d0, d1 = idle.get("decode") or {}, after.get("decode") or {}
        recomputed_tokens = (d1.get("prompt_tokens_local_compute", 0) - d0.get("prompt_tokens_local_compute", 0)
                             - d1.get("probe_prompt_tokens", 0))
        reads = d1.get("nixl_xfer_count", 0) - d0.get("nixl_xfer_count", 0)
        by_id = {r["id"]: r for r in reqs}
        results = [audit.audit_request(
            rec, by_id[rec["id"]]["max_tokens"], self.references.get(by_id[rec["id"]]["index"]),
            attempts.get(rec["id"], 0),
            recomputed=self.cfg.kv_load_failure_policy == "recompute" and rec["id"] == reqs[0]["id"]
            and recomputed_tokens > 0) for rec in records]
        killed = name == "kill_prefill"
        inst = audit.audit_instance("decode", idle.get("decode"), after.get("decode"), None)
        inst += audit.audit_instance("prefill", idle.get("prefill"), after.get("prefill"),
                                     int(prefill_ok - reads), killed=killed)
        summary = audit.summarize(results, inst)
        summary.update({"injection": name, "policy": self.cfg.kv_load_failure_policy,
                        "decode_failed_transfers": d1.get("nixl_num_failed_transfers", 0)
                        - d0.get("nixl_num_failed_transfers", 0),
                        "decode_recomputed_prompt_tokens": recomputed_tokens, "decode_reads": reads,
                        "prefill_answered": prefill_ok, "metrics": {"idle": idle, "after": after},
                        "events": events})
        return summary


def run_policy(cfg, policy: str, injections, out: Path, n: int) -> list[dict]:
    from kvbench.lab.stack.deploy import model_for

    cfg = replace(cfg, kv_load_failure_policy=policy)
    out.mkdir(parents=True, exist_ok=True)
    started: list = []
    results = []
    with stop_on_exit(started):
        st = deploy.bring_up(cfg, "disaggregated", model_for(cfg), out / "logs", started)
        run = FaultRun(st, cfg, out, n, deadline_s=cfg.kv_lease_s + 90)
        run.reference()
        for name in injections:
            print(f"faults: policy={policy} injection={name} ...", file=sys.stderr, flush=True)
            res = run.scenario(name)
            write_new_file(out / f"{name}.audit.json", json.dumps(res, indent=2) + "\n")
            print(f"faults: policy={policy} injection={name}: {one_line(res)}", flush=True)
            results.append(res)
    return results


def one_line(res: dict) -> str:
    outcomes = ", ".join(f"{v} {k}" for k, v in sorted(res["outcomes"].items()))
    verdict = "PASS" if res["passed"] else "FLAGGED"
    return (f"{verdict}: {res['requests']} requests ({outcomes}); duplicate positions "
            f"{res['duplicate_positions']}, missing {res['missing_positions']}; max attempts "
            f"{res['max_attempts']}; decode failed transfers {res['decode_failed_transfers']:g}, "
            f"recomputed prompt tokens {res['decode_recomputed_prompt_tokens']:g}; "
            f"instance problems: {'; '.join(res['instance_problems']) or 'none'}")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="kvbench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", metavar="PLAN.yaml")
    p.add_argument("--out", help="output folder (default lab-faults-<UTC stamp>)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--injections", default=",".join(INJECTIONS))
    p.add_argument("--requests", type=arg_int(1, 10_000), default=6, help="requests per injection (default 6)")
    return p


def _choices(text: str, allowed: tuple, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UsageError(f"{what}: choose from {', '.join(allowed)}, got {text!r}")
    return items


def main(argv=None) -> int:
    from kvbench.lab.planfile import load_lab_section
    from kvbench.lab.stack.env import require_env

    args = build_parser().parse_args(argv)
    policies = _choices(args.policies, POLICIES, "--policies")
    injections = _choices(args.injections, INJECTIONS, "--injections")
    if "kill_prefill" in injections:  # it leaves no prefill behind: always last
        injections = [i for i in injections if i != "kill_prefill"] + ["kill_prefill"]
    if args.requests < 2:
        raise UsageError("--requests must be at least 2")
    cfg = load_lab_section(args.plan)
    require_env()
    out = Path(args.out or f"lab-faults-{utc_stamp()}")
    if out.exists():
        raise UsageError(f"refusing to reuse existing folder {out}")
    results = [r for pol in policies for r in run_policy(cfg, pol, injections, out / pol, args.requests)]
    report = {"schema": SCHEMA_FAULTS, "command": ["kvbench", "faults", *(argv or sys.argv[1:])],
              "passed": all(r["passed"] for r in results),
              "results": [{k: v for k, v in r.items() if k not in ("per_request", "events", "metrics")}
                          for r in results]}
    as_contract(FaultsReport, report, "the fault audit's report")
    write_new_file(out / "faults-report.json", json.dumps(report, indent=2) + "\n")
    print(f"faults: report {out / 'faults-report.json'}: "
          f"{'all audits passed' if report['passed'] else 'FLAGGED, see the report'}")
    return 0 if report["passed"] else 1


def cli(argv=None) -> int:
    return run_interruptible("kvbench faults", main, argv)


if __name__ == "__main__":
    sys.exit(cli())
