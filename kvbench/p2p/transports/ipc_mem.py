"""Sharing one rank's message buffers with a peer process on the same host (--transport ipc).

The exporting rank describes each distinct allocation under its buffers (a *region*) plus
where every buffer lies in it (a `Piece`); the importing rank maps every region once and
builds a view per buffer. After that, a handoff is one copy between the mapped views and the
importer's own buffers: no bytes pass through a socket or a bounce buffer.

Host memory: each region is moved into an anonymous shared mapping in place: a `memfd_create`
file (it has no name in any file system, so nothing can outlive the processes, whatever kills
them, at any moment), its pages reserved up front (`posix_fallocate`: a shortfall is one line
now, not a SIGBUS at the first touch), the bytes copied in and the storage's data pointer
swapped (`UntypedStorage._swap_data_ptr_`), so every existing view of the storage follows the
move. The importer opens the exporter's descriptor through /proc/PID/fd/FD (same host, same
PID namespace, same user) and checks it is the same inode. The kernel frees the memory when
the last mapping goes.

(torch's own `_share_fd_cpu_` is not used: it creates a named /dev/shm/torch_* file and
unlinks it only after reserving its pages, and a process killed in between, a second or two
for a large KV, leaves the name behind.)

CUDA memory: the region's CUDA IPC memory handle (`_share_cuda_`, what torch.multiprocessing
sends), opened by the importer on its own GPU (cudaIpcOpenMemHandle with lazy peer access: the
same GPU, or another GPU of the node reached through the peer mapping), so its copy runs in
its own context; on the exporter's GPU only where the two have no peer access.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.p2p.registry import LazyModule
from kvbench.p2p.transports.base import TransportError
from kvbench.units import fmt_bytes

# imported on first use: the registry imports the ipc transport without torch
# (kvbench.p2p.registry)
torch = LazyModule("torch")


def mem_available_bytes() -> int | None:
    """kvbench.p2p.devices's figure, imported when asked (devices imports torch)."""
    from kvbench.p2p.devices import mem_available_bytes as available

    return available()


@dataclass(frozen=True)
class Piece:
    """Where one message buffer lies: region index, byte offset in it, length in bytes."""

    region: int
    offset: int
    nbytes: int


def group_regions(buffers: Sequence[torch.Tensor]) -> tuple[list[torch.UntypedStorage], list[Piece]]:
    """The distinct storages under `buffers` (flat uint8 views) and each buffer's place in them.
    Call again after a storage moved (its data pointer changes)."""
    storages: list[torch.UntypedStorage] = []
    index: dict[int, int] = {}
    pieces = []
    for b in buffers:
        if b.dtype != torch.uint8 or b.dim() != 1 or not b.is_contiguous():
            raise TransportError("ipc: message buffers must be flat contiguous byte views")
        st = b.untyped_storage()
        key = st.data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(st)
        pieces.append(Piece(index[key], b.data_ptr() - key, b.numel()))
    return storages, pieces


# -- host memory ---------------------------------------------------------------------------------


def export_host(buffers: Sequence[torch.Tensor]) -> dict:
    """Move the buffers' storages into anonymous shared memory (in place) and describe them.
    The caller has made the buffers' contents final (queued device work applied): the move
    copies the bytes."""
    storages, _ = group_regions(buffers)
    check_room(sum(st.nbytes() for st in storages if not st.is_shared()))
    regions = []
    for st in storages:
        if not st.nbytes():  # nothing to map (a message of no bytes)
            regions.append({"fd": None, "nbytes": 0, "inode": None})
            continue
        fd = move_to_memfd(st)
        info = os.fstat(fd)
        regions.append({"fd": fd, "nbytes": st.nbytes(), "inode": (info.st_dev, info.st_ino)})
    _, pieces = group_regions(buffers)  # pointers moved: offsets from the new storages
    return {"kind": "shm", "pid": os.getpid(), "pid_ns": pid_namespace(), "regions": regions,
            "pieces": pieces}


def can_move_in_place() -> str | None:
    """Why this torch cannot move a storage into shared memory in place (None: it can)."""
    if not hasattr(os, "memfd_create"):
        return "--transport ipc needs memfd_create (Linux)"
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return (f"--transport ipc needs a torch with UntypedStorage._swap_data_ptr_ (torch "
                f"{torch.__version__} has none)")
    return None


def move_to_memfd(st: torch.UntypedStorage) -> int:
    """The descriptor of `st`'s memory after moving it into a memfd (already shared: as it is).
    `st` holds at least one byte."""
    if st.is_shared():
        return st._get_shared_fd()
    nbytes = st.nbytes()
    fd = os.memfd_create("kvbench-ipc", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        shared = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a dup of fd
    except OSError as exc:
        raise TransportError(f"ipc: cannot reserve {fmt_bytes(nbytes)} of shared memory: "
                             f"{exc.strerror}") from None
    finally:
        os.close(fd)
    shared.copy_(st)
    st._swap_data_ptr_(shared)  # every view of st now reads the shared pages
    return st._get_shared_fd()


SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_huge_pages(path: str = SHMEM_THP) -> str | None:
    """The host's transparent-huge-page policy for shared memory (the bracketed word of
    `path`: never, always, within_size, advise, deny, force; None where unknown). kvbench's
    private host buffers are advised huge pages (numpy advises them for large arrays); a
    memfd gets them only where this allows. Where it is `never` (the kernel's default), a
    98 MB KV read through the mapping copied at 0.85-0.92 of the private floor on this
    project's host, as fast as small private pages (docs/same-host.md): a property of the
    host that a record should carry."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def pid_namespace() -> int | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid), None where unknown:
    tells "the producer has exited" apart from "the producer is in another namespace"."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def check_room(nbytes: int) -> None:
    """Refuse with one line before a move the host cannot hold: for a moment the bytes live
    twice (the private copy and the shared one), and shared pages are not swapped out lightly."""
    free = mem_available_bytes()
    if free is not None and nbytes > free:
        raise TransportError(f"ipc: {fmt_bytes(nbytes)} must be copied into shared memory but "
                             f"the host has {fmt_bytes(free)} available")


class HostMapping:
    """The importer's side: every region mapped once, a view per buffer."""

    def __init__(self, handle: dict):
        self.maps: list[mmap.mmap] = []
        flats = [self._map(handle["pid"], handle.get("pid_ns"), r) for r in handle["regions"]]
        self.views = [flats[p.region][p.offset:p.offset + p.nbytes] for p in handle["pieces"]]

    def _map(self, pid: int, pid_ns: int | None, region: dict) -> torch.Tensor:
        if not region["nbytes"]:
            return torch.empty(0, dtype=torch.uint8)
        path = f"/proc/{pid}/fd/{region['fd']}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            # In one PID namespace the producer's descriptor vanishes only when it exits
            # (it holds it until the consumer is done): what a rank continued after the
            # job's abort sees, the producer gone or a zombie with its files closed.
            same_ns = pid_ns is not None and pid_ns == pid_namespace()
            if same_ns and exc.errno == errno.ENOENT:
                raise TransportError(f"ipc: the producer (pid {pid}) has exited before its "
                                     "shared memory was mapped") from None
            raise TransportError(f"ipc: cannot open the producer's shared memory at {path} "
                                 f"({exc.strerror}): the ranks must share a host, a PID "
                                 "namespace and a user") from None
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != tuple(region["inode"]) or info.st_size < region["nbytes"]:
                raise TransportError(f"ipc: {path} is not the producer's shared memory (another "
                                     "host or PID namespace behind the same name?)")
            m = mmap.mmap(fd, region["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.maps.append(m)
        return torch.frombuffer(m, dtype=torch.uint8)

    def close(self) -> None:
        """Drop the views and unmap (a view still held elsewhere keeps its map until freed)."""
        self.views = []
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a tensor over it is still alive: freed with it
                pass
        self.maps = []


# -- CUDA memory ---------------------------------------------------------------------------------


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid` (None: not visible here)."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    return None


def export_cuda(buffers: Sequence[torch.Tensor]) -> dict:
    """CUDA IPC handles of the buffers' allocations, and the GPU they live on (by UUID)."""
    storages, pieces = group_regions(buffers)
    device = buffers[0].device.index
    return {"kind": "cuda_ipc", "uuid": gpu_uuid(device),
            "regions": [st._share_cuda_() for st in storages], "pieces": pieces}


OWN_GPU = "the copying rank's own GPU"
PRODUCER_GPU = "the exporting rank's GPU (this rank's GPU cannot map it: no peer access)"


class CudaMapping:
    """The importer's side on CUDA: every handle opened once, on this rank's own GPU (its
    current device), so the copy runs in this rank's context on its own stream and reaches
    another GPU's memory through the peer mapping cudaIpcOpenMemHandle makes
    (cudaIpcMemLazyEnablePeerAccess). Opening on the exporter's GPU instead, as torch's
    multiprocessing does, would run this rank's copy in a second context on that GPU. Where
    the two GPUs have no peer access, on the exporter's GPU when it is visible here.
    `opened_on` says which."""

    def __init__(self, handle: dict, own: int | None = None):
        there = local_gpu(handle["uuid"])
        if not torch.cuda.is_available():
            raise TransportError(f"ipc: the producer's GPU {handle['uuid']} is not visible to this "
                                 "rank, which has no GPU to open its handles on")
        own = torch.cuda.current_device() if own is None else own
        try:
            self.device, self.opened_on = torch.device("cuda", own), OWN_GPU
            flats = _open_regions(handle["regions"], own)
        except RuntimeError as exc:  # no peer access between the two GPUs
            if there is None or there == own:
                raise TransportError(f"ipc: cannot open the producer's CUDA IPC handles on GPU "
                                     f"{own} ({exc}); the producer's GPU {handle['uuid']} is not "
                                     "visible to this rank (CUDA_VISIBLE_DEVICES)") from None
            self.device, self.opened_on = torch.device("cuda", there), PRODUCER_GPU
            flats = _open_regions(handle["regions"], there)
        self.views = [flats[p.region][p.offset:p.offset + p.nbytes] for p in handle["pieces"]]

    def close(self) -> None:
        self.views = []


def _open_regions(regions: Sequence, device: int) -> list[torch.Tensor]:
    """Each exported region (torch's _share_cuda_ tuple) opened in `device`'s context, as a
    flat byte tensor on that device."""
    flats = []
    for reg in regions:
        st = torch.UntypedStorage._new_shared_cuda(device, *reg[1:])
        flats.append(torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(st))
    return flats
