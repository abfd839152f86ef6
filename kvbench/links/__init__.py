"""The link vocabulary: which path a record's KV took and why.

Torch-free and MPI-free, so the fit, the matrix and the report can read a record's link
without the runtime: `linkpath` (the link kinds, the readers of NCCL's and UCX's words that
each transport's own `link_path` hook uses, and the rules for records no installed transport
declares; it never branches on a transport's name), `linkcauses` (why a path is not the
link it should be, and the fix), `nccl_log` (NCCL's own debug log, read for its channels)
and `ucx_rows` (UCX's protocol rows, split into the KV's own path and the rest).

May import: kvbench.errors, kvbench.units. Must not import torch, mpi4py or kvbench.p2p.
"""
