"""`kvbench faults`: failed KV transfers injected into the P/D deployment (main) and the
per-request audit of what came back (audit).

May import lab.stack, lab.load, the lab's planfile and config; never the lab CLI.
"""
