"""A matrix job's lean records: what is per job is written once, in the job's first record.

Why: a matrix job (pattern matrix) writes N(N-1) pair records per size, and each would repeat
what belongs to the whole job: its N hosts (`hosts` and `spec.hosts`), every rank's GPUs
(`gpus`), rank 0's environment (`env.ranks`) and its round's N/2 pairs
(`schedule.pairs_in_round`): tens of KB a record at N = 1,024, ~50 GB a job. So the job's
first record is written whole, with the schedule's every round (`schedule.pairs_by_round`),
and every later record of the job is *lean*: it says `job_in: "the first record"` and keeps
its own pair, the hosts of its two ranks (`sender`, `receiver`), its samples, its path and its
spec id (the hash of its whole spec, hosts included: the same id as a whole record's).

Readers make a lean record whole again from its job's first record (the same `run_id`,
earlier in the same file): the first record's own objects, shared by every record of the
job, not copied. A lean record whose first record is not before it (a file cut or
reordered) is refused in one line: filling it from another job would mis-group it silently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

from kvbench.errors import UsageError

JOB_IN = "the first record"
# a job's first record holds these whole; its later records leave them out
PER_JOB_TOP = ("hosts", "gpus")


@dataclass
class Job:
    """What a job's first record says for every record of the job (its own objects)."""

    hosts: list
    gpus: object
    env_ranks: object  # the first record's env.ranks (every rank's environment)
    rounds: list | None  # schedule.pairs_by_round
    hosts_json: str  # the hosts as canonical JSON (spec ids are hashed over them)


# ---------------------------------------------------------------------------
# writing


def make_lean(records: list[dict]) -> None:
    """In place: the records of one per-pair job (the first one has `pair`) after the first
    leave what is per job to the first, which gains the schedule's every round. Records
    without a run_id (nothing to name their job by) stay whole."""
    if len(records) < 2 or records[0].get("pair") is None or not records[0].get("run_id"):
        return
    first = records[0]
    rounds = _rounds_of(records)
    if rounds is None:
        return
    first_of_job(first, rounds)
    for rec in records[1:]:
        if rec.get("pair") is not None and rec.get("run_id") == first["run_id"]:
            lean(rec)


def first_of_job(first: dict, rounds: list) -> dict:
    """In place: a job's first record, whole, with every round's pairs (its job's schedule)."""
    first["schedule"] = {**first["schedule"], "pairs_by_round": rounds}
    return first


def lean(rec: dict) -> dict:
    """In place: a later record of a per-pair job without what its first record holds."""
    for k in PER_JOB_TOP:
        rec.pop(k, None)
    if isinstance(rec.get("spec"), dict):
        rec["spec"] = {k: v for k, v in rec["spec"].items() if k != "hosts"}
    if isinstance(rec.get("schedule"), dict):
        rec["schedule"] = {k: v for k, v in rec["schedule"].items() if k != "pairs_in_round"}
    if isinstance(rec.get("env"), dict):
        rec["env"] = {k: v for k, v in rec["env"].items() if k != "ranks"}
        rec["env"]["ranks_in"] = JOB_IN
    rec["job_in"] = JOB_IN
    return rec


def _rounds_of(records: list[dict]) -> list | None:
    """Every round's pairs (schedule.pairs_in_round by schedule.round), None when some round
    is not said by any record (then every record keeps its own)."""
    by: dict[int, list] = {}
    total = None
    for rec in records:
        s = rec.get("schedule")
        if not isinstance(s, dict) or not isinstance(s.get("round"), int):
            return None
        total = s.get("rounds")
        if "pairs_in_round" in s:
            by.setdefault(s["round"], s["pairs_in_round"])
    if not isinstance(total, int) or set(by) != set(range(total)):
        return None
    return [by[k] for k in range(total)]


# ---------------------------------------------------------------------------
# reading


def missing_first(where: str, run_id) -> UsageError:
    return UsageError(
        f"{where}: a lean matrix record (job_in: {JOB_IN!r}) of run {run_id!r}, but no record of "
        f"that run came before it: the job's first record (its hosts, schedule, every rank's "
        f"environment) is missing; the file was cut or reordered: give the whole file as written")


def _job_of(hosts: list, gpus, env, schedule) -> Job:
    ranks = env.get("ranks") if isinstance(env, dict) else None
    rounds = schedule.get("pairs_by_round") if isinstance(schedule, dict) else None
    return Job(hosts, gpus, ranks, rounds if isinstance(rounds, list) else None,
               json.dumps(hosts, separators=(",", ":")))


def _pairs_in_round(job: Job, schedule, where: str):
    k = schedule.get("round") if isinstance(schedule, dict) else None
    if job.rounds is None or type(k) is not int or not 0 <= k < len(job.rounds):
        raise UsageError(f"{where}: a lean matrix record names round {k!r}, which its job's "
                         f"first record does not hold ({len(job.rounds or [])} rounds)")
    return job.rounds[k]


class Jobs:
    """The jobs of one file as its records are read, in order: whole records name their job
    (by run_id: the first one seen), lean records are filled from it."""

    def __init__(self):
        self._by_run: dict = {}
        self._checked: set = set()  # (spec_id, lean spec text, job) whose hash was checked

    # -- typed records (kvbench.records.schema.p2p.P2PRecord) ----------------------

    def typed(self, rec, where: str):
        """The record, whole: a lean one filled in place (its job's objects, shared)."""
        if rec.job_in is None:
            if rec.run_id is not None and rec.run_id not in self._by_run:
                extra = rec.__pydantic_extra__ or {}
                self._by_run[rec.run_id] = _job_of(rec.hosts, extra.get("gpus"),
                                                   extra.get("env"), extra.get("schedule"))
                if rec.spec is not None and rec.spec.hosts == rec.hosts:
                    rec.spec.__dict__["hosts"] = rec.hosts  # one list, not two
            return rec
        job = self._by_run.get(rec.run_id)
        if job is None:
            raise missing_first(where, rec.run_id)
        d, extra = rec.__dict__, rec.__pydantic_extra__
        d["hosts"] = job.hosts
        rec.__pydantic_fields_set__.add("hosts")
        extra["gpus"] = job.gpus
        env = extra.get("env")
        if isinstance(env, dict):
            env["ranks"] = job.env_ranks
        sched = extra.get("schedule")
        if isinstance(sched, dict):
            sched["pairs_in_round"] = _pairs_in_round(job, sched, where)
        if rec.spec is not None:
            self._spec_hosts(rec, job, where)
        return rec

    def _spec_hosts(self, rec, job: Job, where: str) -> None:
        """spec.hosts filled, and spec_id checked to be the hash of the whole spec (once per
        distinct lean spec of the job: a pair's sizes share one)."""
        spec = rec.spec
        if spec.hosts is not None:
            raise UsageError(f"{where}: a lean matrix record carries spec.hosts; a lean record "
                             "leaves them to its job's first record")
        lean = spec.model_dump_json(exclude_unset=True)
        key = (rec.spec_id, lean, id(job))
        if key not in self._checked:
            actual = spec_id_with_hosts(json.loads(lean), job.hosts_json)
            if actual != rec.spec_id:
                raise UsageError(f"{where}: spec_id {rec.spec_id!r} is not the hash of spec "
                                 f"with its job's hosts ({actual}): the record was edited or "
                                 "mixed up with another job's")
            if len(self._checked) >= 1 << 20:
                self._checked.clear()
            self._checked.add(key)
        spec.__dict__["hosts"] = job.hosts
        spec.__pydantic_fields_set__.add("hosts")

    # -- record dicts -----------------------------------------------------------

    def plain(self, rec: dict, where: str) -> dict:
        """A record dict, whole: a lean one filled in place (its job's objects, shared); its
        spec_id is checked where the spec is hashed (kvbench.fit.data groups by the spec)."""
        if rec.get("job_in") is None:
            rid = rec.get("run_id")
            if isinstance(rid, str) and rid not in self._by_run and isinstance(
                    rec.get("hosts"), list):
                self._by_run[rid] = _job_of(rec["hosts"], rec.get("gpus"), rec.get("env"),
                                            rec.get("schedule"))
            return rec
        job = self._by_run.get(rec.get("run_id"))
        if job is None:
            raise missing_first(where, rec.get("run_id"))
        rec["hosts"], rec["gpus"] = job.hosts, job.gpus
        if isinstance(rec.get("env"), dict):
            rec["env"]["ranks"] = job.env_ranks
        if isinstance(rec.get("schedule"), dict):
            rec["schedule"]["pairs_in_round"] = _pairs_in_round(job, rec["schedule"], where)
        if isinstance(rec.get("spec"), dict) and "hosts" not in rec["spec"]:
            rec["spec"] = with_hosts(rec["spec"], job.hosts)
        return rec


def with_hosts(spec: dict, hosts: list) -> dict:
    """A lean spec with its job's hosts where a whole one has them (after `world`)."""
    out: dict = {}
    for k, v in spec.items():
        out[k] = v
        if k == "world":
            out["hosts"] = hosts
    out.setdefault("hosts", hosts)
    return out


_HOSTS = "\x00kvbench job hosts\x00"
_HOSTS_JSON = json.dumps(_HOSTS)


def spec_id_with_hosts(lean: dict, hosts_json: str) -> str:
    """spec_id_of(lean spec + hosts) without re-encoding the N hosts for every pair: the
    canonical text of the small spec with a placeholder, the job's hosts text put in its place
    (canonical JSON sorts keys, so the text is the same as the whole spec's)."""
    text = json.dumps({**lean, "hosts": _HOSTS}, sort_keys=True, separators=(",", ":"))
    if text.count(_HOSTS_JSON) != 1:
        raise UsageError("a spec holds kvbench's own placeholder text; it cannot be checked")
    head, tail = text.split(_HOSTS_JSON)
    key = (head, hosts_json)  # (the pairs of a matrix share the keys that sort before hosts)
    hashed = _HASHED_TO_HOSTS.get(key)
    if hashed is None:
        if len(_HASHED_TO_HOSTS) >= 64:
            _HASHED_TO_HOSTS.clear()
        hashed = _HASHED_TO_HOSTS[key] = hashlib.sha256((head + hosts_json).encode())
    h = hashed.copy()  # the N hosts hashed once, not once a pair
    h.update(tail.encode())
    return h.hexdigest()[:12]


_HASHED_TO_HOSTS: dict[tuple[str, str], object] = {}  # (text before hosts, hosts) -> sha256 so far


def whole_dicts(path) -> Iterator[dict]:
    """A results file's records as dicts (the bounded JSON reader's), lean ones made whole:
    for a script or test that reads records without the typed model."""
    from kvbench.records.schema.read import decode_line, iter_lines

    jobs = Jobs()
    for where, raw in iter_lines(path, "results file", missing="no such file"):
        yield jobs.plain(decode_line(raw, where), where)
