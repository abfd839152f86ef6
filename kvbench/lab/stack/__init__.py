"""The lab's serving stack: its venv (env), its processes (procs), a deployment of real vLLM
instances (deploy), /metrics captured from it (capture) and the two stack findings measured
with each workaround on and off (findings).

May import kvbench.cli, records, p2p and slo, the lab's config and planfile, lab.venv and
lab.load; never the lab CLI or the commands above it (sweep, faults, agree).
"""
