"""The KV vocabulary shared by model, p2p, plan and fit, torch-free.

`geometry` is the one calculator from tokens to bytes (dtypes, a model's KV geometry, scales,
paged blocks, heads per TP rank); `cut` turns a model, a prompt length and a layout
(contiguous, paged, engine blocks) into the regions a handoff moves; `shards` is the
tensor-parallel plan (which prefill rank's heads go to which decode rank).

Sits below kvbench.model (which re-exports the geometry's names beside its presets).
May import: kvbench.errors, kvbench.records. Must not import torch or mpi4py at module
level, nor kvbench.model or anything above it.
"""
