"""The KV vocabulary shared by model, p2p, plan and fit, torch-free.

`cut` turns a model, a prompt length and a layout (contiguous, paged, engine blocks) into
the regions a handoff moves; `shards` is the tensor-parallel plan (which prefill rank's
heads go to which decode rank).

May import: kvbench.errors, kvbench.model, kvbench.records. Must not import torch or mpi4py
at module level, nor kvbench.p2p.
"""
