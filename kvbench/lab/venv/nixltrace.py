"""Per-transfer trace of the engine's NIXL READs, from inside vLLM's decode worker.

vLLM's histograms give the exact mean of a run's transfers but not where each one's time
went. With `KVBENCH_NIXL_TRACE=FILE` in a decode instance's environment,
kvbench.lab.venv.connector wraps four calls of the worker's NIXL agent (nothing else changes):

    transfer(handle)          the post: its start/end on this process's clock and the state
                              NIXL returned ("DONE" when the READ finished inside the call)
    check_xfer_state(handle)  every look vLLM's step makes (the same step's, then one per
                              engine step: vllm/v1/worker/kv_connector_model_runner_mixin.py)
    get_xfer_telemetry(handle) NIXL's own numbers (the ones behind vLLM's histograms)
    release_xfer_handle(handle) the line is written: one JSON object per transfer
    send_notif(agent, msg)    a notification outside a transfer (vLLM's lease heartbeats,
                              "HB:..."): counted per transfer between its post and first look

Line (times in microseconds from the post's start, perf_counter):
    {"post_end_us": ..., "post_state": "PROC"|"DONE"|"ERR", "looks": [[us, state], ...],
     "tel": {"post_us", "xfer_us", "bytes", "descs"}, "unix": wall time of the post,
     "notifs": [us of each send_notif after the post, before the first look]}

So each transfer says whether the READ was still in flight at the look in its own step
(`looks[0]` is PROC) and how long the next step took to look again. The cost is one
perf_counter per call and one short write per transfer (< 0.1 ms), outside the timed
post. kvbench.lab.agree.engine reads the lines back.
"""

from __future__ import annotations

import json
import os
import time

ENV = "KVBENCH_NIXL_TRACE"


def _us(t0_ns: int) -> float:
    return (time.perf_counter_ns() - t0_ns) / 1e3


class Tracer:
    """Wraps one NIXL agent object's calls in place (instance attributes shadow methods)."""

    def __init__(self, agent, path: str):
        self.agent, self.path = agent, path
        self.open: dict[int, dict] = {}
        self.real = {name: getattr(agent, name) for name in
                     ("transfer", "check_xfer_state", "get_xfer_telemetry", "release_xfer_handle",
                      "send_notif")}
        for name in self.real:
            setattr(agent, name, getattr(self, name))

    def transfer(self, handle, *args, **kwargs):
        t0, unix = time.perf_counter_ns(), time.time()
        state = self.real["transfer"](handle, *args, **kwargs)
        self.open[id(handle)] = {"t0": t0, "unix": unix, "post_end_us": _us(t0),
                                 "post_state": state, "looks": []}
        return state

    def send_notif(self, *args, **kwargs):
        for rec in self.open.values():
            if not rec["looks"]:
                rec.setdefault("notifs", []).append(round(_us(rec["t0"]), 1))
        return self.real["send_notif"](*args, **kwargs)

    def check_xfer_state(self, handle):
        state = self.real["check_xfer_state"](handle)
        rec = self.open.get(id(handle))
        if rec is not None:
            rec["looks"].append([round(_us(rec["t0"]), 1), state])
        return state

    def get_xfer_telemetry(self, handle):
        res = self.real["get_xfer_telemetry"](handle)
        rec = self.open.get(id(handle))
        if rec is not None and res is not None:
            rec["tel"] = {"post_us": res.postDuration, "xfer_us": res.xferDuration,
                          "bytes": res.totalBytes, "descs": res.descCount}
        return res

    def release_xfer_handle(self, handle):
        rec = self.open.pop(id(handle), None)
        out = self.real["release_xfer_handle"](handle)
        if rec is not None:
            rec.pop("t0")
            rec["post_end_us"] = round(rec["post_end_us"], 1)
            with open(self.path, "a") as fh:  # one short line per transfer
                fh.write(json.dumps(rec) + "\n")
        return out


def install(worker) -> Tracer | None:
    """Trace `worker.nixl_wrapper` when KVBENCH_NIXL_TRACE names a file, else nothing."""
    path = os.environ.get(ENV)
    agent = getattr(worker, "nixl_wrapper", None)
    if not path or agent is None:
        return None
    return Tracer(agent, path)
