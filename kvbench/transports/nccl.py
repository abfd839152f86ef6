"""torch.distributed with the NCCL backend (GPU only).

NCCL picks its own path (P2P/NVLink, SHM, NET/IB, NET/Socket). Which one it used is read
from its own debug output when the run sets NCCL_DEBUG=INFO, not assumed from a label.

NCCL connects a peer lazily, and the first call on a pair blocks the host thread until the
peer posts its matching call. So `open()` connects every (src, dst) pair the run will use,
with a grouped both-sides exchange in one global order (`_torchdist.preconnect`), before
anything is timed; and a rank's posts of one step (several peers included) go out as one
`batch_isend_irecv` group, so they do not queue one after another on one stream.
NCCL is stream-ordered: its operations wait for earlier work on the current stream, so the
readiness event needs no host wait.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from kvbench.transports import register
from kvbench.transports._torchdist import TorchDistTransport


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
        # The harness has already bound this rank to its local GPU (p2p.select_local_gpu).
        # Ask NCCL itself which path it wires up, into a private file we parse afterwards.
        self.debug_file = None
        if "NCCL_DEBUG" not in os.environ:
            self.debug_file = Path(tempfile.gettempdir()) / f"kvbench-nccl-{os.getpid()}.log"
            os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,NET",
                              NCCL_DEBUG_FILE=str(self.debug_file))
        super().open()

    def carried_by(self) -> list[str]:
        """Channel lines NCCL logged, e.g. 'via P2P/IPC', 'via SHM', 'via NET/IB/0'."""
        if not self.debug_file or not self.debug_file.exists():
            return []
        found = re.findall(r"via (\S+)", self.debug_file.read_text(errors="replace"))
        return sorted(set(found))

    def info(self) -> dict:
        paths = self.carried_by()
        return {**super().info(),
                "path": ", ".join(paths) if paths else "unknown (NCCL_DEBUG set by the user: see the job log)",
                "nccl_debug": os.environ.get("NCCL_DEBUG")}
