"""torch.distributed with the NCCL backend (GPU only).

NCCL picks its own path (P2P/NVLink, SHM, NET/IB, NET/Socket). Which one it used is read
from its own debug log (kvbench.links.nccl_log), not assumed from a label.

NCCL connects a peer lazily, and the first call on a pair blocks the host thread until the
peer posts its matching call. So `open()` connects every (src, dst) pair the run will use,
with a grouped both-sides exchange in one global order (`torchdist.preconnect`), before
anything is timed; and a rank's posts of one step (several peers included) go out through
`batch_isend_irecv`, a single one too, interleaved across peers in groups of up to
`torchdist.GROUP_MAX`, so they do not queue one after another on one stream (see
`torchdist` for why a lone `isend` would hang).
NCCL is stream-ordered: its operations wait for earlier work on the current stream, so the
readiness event needs no host wait.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvbench.links import nccl_log
from kvbench.links.linkpath import LinkPath, PairFacts, classify_nccl
from kvbench.p2p.transports import register
from kvbench.p2p.transports.torchdist import TorchDistTransport


@register
class NCCLTransport(TorchDistTransport):
    name = "nccl"
    description = "torch.distributed NCCL send/recv between GPUs (GPU only)"
    backend = "nccl"
    gpu_only = True
    poll_completion = True
    stream_ordered = True
    batch_posts = True
    lazy_connect = True

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "nccl needs a CUDA GPU and none is visible"
        if device != "cuda":
            return "nccl moves device memory: use --device cuda"
        import torch.distributed as dist

        if not dist.is_nccl_available():
            return "this torch build has no NCCL"
        return None

    def open(self) -> None:
        # The harness has already bound this rank to its local GPU (kvbench.p2p.gpu_select).
        # Ask NCCL itself which path it wires up, into a private file per rank, parsed at the
        # end. GRAPH adds the topology's GPU-to-GPU path type: P2P alone can be NVLink or PCIe.
        self.debug_file = None
        if "NCCL_DEBUG" not in os.environ:
            self.debug_file = Path(tempfile.gettempdir()) / f"kvbench-nccl-{os.getpid()}.log"
            os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,NET,GRAPH",
                              NCCL_DEBUG_FILE=str(self.debug_file))
        super().open()

    def info(self) -> dict:
        """Collective (p2p calls it on every rank): every rank's NCCL log, merged, since a
        sender and a receiver each log their own side of a connection."""
        mine = None
        if self.debug_file and self.debug_file.exists():
            mine = nccl_log.parse(self.debug_file.read_text(errors="replace"))
        logs = [log for log in self.ctx.comm.allgather(mine) if log is not None]
        self.merged = merged = nccl_log.merge(logs) if logs else None
        return {**super().info(), **self._path_fields(merged),
                "nccl_debug": os.environ.get("NCCL_DEBUG")}

    def _path_fields(self, log: nccl_log.NcclLog | None) -> dict:
        path = log.path() if log else None
        if path is None:
            path = ("unknown (NCCL_DEBUG set by the user: see the job log)" if not self.debug_file
                    else "unknown (NCCL logged no channel connection)")
        return {"path": path, "nccl": log.as_dict() if log else None}

    def info_by_pair(self, info: dict, pairs) -> dict:
        """Per pair, the channel connections NCCL logged from its sender to its receiver (every
        rank holds the merged log `info` gathered: no communication)."""
        merged = getattr(self, "merged", None)
        return {(s, d): {**info, **self._path_fields(merged.for_pair(s, d) if merged else None)}
                for s, d in pairs}

    @classmethod
    def link_path(cls, info: dict, pair: PairFacts) -> LinkPath:
        """The channel transports NCCL logged (older records: the joined path string)."""
        return classify_nccl(info)
