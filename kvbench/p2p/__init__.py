"""The main job: `mpirun -n 2 python -m kvbench.p2p` measures prefill -> decode KV handoffs.

Owns the measurement: the one handoff engine (engine.py) and its timing loop (harness.py),
the frozen spec of what was measured (spec.py), KV tensors and their layouts (layout.py,
devices.py, messages.py, compute.py), the MPI world and its watchdog (world.py,
watchdog.py), GPU facts (gpu_select.py, cuda_kernels.py; the torch-free link vocabulary lives in
kvbench.links, the KV cut and shard plan in kvbench.kv), the bare-transport
yardstick (baseline.py), the handoff patterns (patterns/) and the transports (transports/).
args.py parses the flags (helpview.py: which of them --help lists), cli.py runs the job.
Each transport declares what the rest of kvbench knows of it (transports/base.py).

May import: kvbench.units, kvbench.cli, kvbench.model, kvbench.records, kvbench.kv,
kvbench.links. Never fit, plan, slo, lab or report (tests/test_layout.py keeps it so).

Host-to-host copies that kvbench times (the ipc transport's) and the --baseline floor use the
host's own memcpy, not torch's copy_ (hostcopy.py).
"""
