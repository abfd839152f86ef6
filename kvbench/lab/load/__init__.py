"""Load on a deployment and the reference it is judged by: `vllm bench serve` runs (bench),
the other load generators (clients), /metrics snapshots (snapshot) and the p2p fits of the
KV handoff on the lab's geometry (handoff).

May import kvbench.errors and slo; no other lab module.
"""
