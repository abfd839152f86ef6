"""Every process the lab starts, tracked by PID and stopped on exit, failure or Ctrl-C.

Why a module of its own: a vLLM instance is a tree (API server, engine core, worker,
resource tracker), several per deployment, on a machine other people share. We start
each service in a new session (its own process group), record (pid, start time) in a
state file, and stop it by signalling that group only: never by name, and never a
PID that has since been reused by an unrelated process (the start time in
/proc/PID/stat must still match).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


def proc_start_ticks(pid: int) -> int | None:
    """Start time of pid in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[19])


@dataclass
class Service:
    """One started process group: an instance or a proxy."""

    name: str
    role: str  # aggregated | prefill | decode | proxy
    pid: int
    start_ticks: int
    port: int
    log: str
    cores: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        """True while the leader is the same process we started (not a reused PID)."""
        return proc_start_ticks(self.pid) == self.start_ticks

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def signal(self, sig: int) -> None:
        """Send sig to the whole group; a group that is gone is not an error."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass


def spawn(name: str, role: str, cmd: list[str], env: dict, port: int, log: Path,
          cores: list[int] | None = None, extra: dict | None = None) -> Service:
    """Start cmd in a new session, stdout+stderr to log; returns its tracked Service."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    ticks = proc_start_ticks(proc.pid)
    if ticks is None:  # died at once; keep a record so the caller reports its log
        ticks = -1
    return Service(name, role, proc.pid, ticks, port, str(log), list(cores or []), dict(extra or {}))


def stop(service: Service, grace_s: float = 15.0) -> str:
    """SIGTERM the group (SIGCONT first: a stopped group ignores TERM), then SIGKILL."""
    if service.start_ticks >= 0 and not service.alive() and not _ours_group(service):
        return "gone"
    service.signal(signal.SIGCONT)
    service.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(service.pid)
        if not service.group_alive():
            return "stopped"
        time.sleep(0.2)
    service.signal(signal.SIGKILL)
    time.sleep(0.2)
    _reap(service.pid)
    return "killed"


def _ours_group(service: Service) -> bool:
    """The leader is gone but members of its group may live on (vLLM's engine core)."""
    return service.group_alive() and proc_start_ticks(service.pid) is None


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


@dataclass
class LabState:
    """What `lab up` started: written next to the logs, read by `lab down` and the sweep."""

    deployment: str
    services: list[Service]
    endpoint: str
    metrics_endpoints: dict[str, list[str]]
    info: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @staticmethod
    def from_json(text: str) -> LabState:
        data = json.loads(text)
        data["services"] = [Service(**s) for s in data["services"]]
        return LabState(**data)

    def by_role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]


def write_state(path: Path, state: LabState) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(path)


def stop_all(services: list[Service], out=sys.stderr) -> None:
    """Stop proxies first (no new traffic), then instances, each by its own group."""
    for svc in sorted(services, key=lambda s: s.role != "proxy"):
        outcome = stop(svc)
        print(f"lab: {svc.name} (pid {svc.pid}): {outcome}", file=out, flush=True)


@contextmanager
def stop_on_exit(services: list[Service]):
    """Stop every service in the list on leaving the block: exit, exception, Ctrl-C or SIGTERM.

    SIGTERM is turned into KeyboardInterrupt inside the block so that `kill` of the
    sweep or of `lab up --foreground` still cleans up.
    """
    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, _term)
    try:
        yield services
    finally:
        signal.signal(signal.SIGTERM, old)
        stop_all(services)


def run_interruptible(prog: str, fn, argv) -> int:
    """kvbench.cli.run_main, plus Ctrl-C as one line and exit 130 (the stop_on_exit blocks
    inside have already stopped every process by the time the interrupt arrives here)."""
    from kvbench.cli import run_main

    try:
        return run_main(prog, fn, argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
