"""How a rank's KV is cut into messages for a granularity.

    whole  one message for everything (contiguous: the backing buffer itself;
           paged: blocks packed into one staging buffer)
    layer  one message per layer tensor (K, V, or MLA latent), back to back
    block  one message per paged block (contiguous: per block_size tokens)

Zero-copy where the layout allows it. Where it does not (paged KV sent as layers or as
one message) the sender packs and the receiver unpacks, and both steps are inside the
timed handoff, because a real system pays them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.p2p.layout import KVCache, RawBuffer, as_bytes, empty

GRANULARITIES = ("whole", "layer", "block")


@dataclass
class MessagePlan:
    buffers: list[torch.Tensor]  # flat uint8, one per message
    layer_of: list[int]  # layer each message belongs to (-1: all layers)
    packed: bool = False
    # (message index, layer, part, staging view) for pack/unpack, in message order
    _pack_steps: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    _cache: KVCache | None = None
    # engine-shaped plans (kvbench.p2p.transports.nixl.engine_shape.plan_engine): the registered regions and
    # each message's (region, block id); None for every other plan
    regions: list | None = None
    blocks: list[tuple[int, int]] | None = None

    @property
    def n(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def messages_for_layer(self, layer: int) -> list[int]:
        if not hasattr(self, "_by_layer"):
            self._by_layer: dict[int, list[int]] = {}
            for i, lay in enumerate(self.layer_of):
                self._by_layer.setdefault(lay, []).append(i)
        return self._by_layer.get(layer, [])

    def _steps(self, message: int | None):
        if message is None:
            return self._pack_steps
        if not hasattr(self, "_by_message"):
            self._by_message: dict[int, list] = {}
            for step in self._pack_steps:
                self._by_message.setdefault(step[0], []).append(step)
        return self._by_message.get(message, ())

    def pack(self, message: int | None = None) -> None:
        """Sender: copy the KV into staging for `message` (all messages when None). With
        --pack-kernel cuda: one kernel launch for the message (cuda_kernels.BlockPacker)."""
        packer = self._block_packer()
        if packer is not None:
            packer.pack(message)
            return
        for _i, layer, part, view in self._steps(message):
            self._cache.gather(layer, part, out=view)

    def unpack(self, message: int | None = None) -> None:
        """Receiver: copy staging back into this rank's own cache blocks."""
        packer = self._block_packer()
        if packer is not None:
            packer.unpack(message)
            return
        for _i, layer, part, view in self._steps(message):
            self._cache.scatter(layer, part, view)

    def block_steps(self) -> list[tuple[int, torch.Tensor, list[int], torch.Tensor]]:
        """(message, pool, block ids, staging view) per packed (layer, part), in message order:
        what one launch of the CUDA kernel copies (cuda_kernels.block_pointers)."""
        c = self._cache
        return [(i, c.tensors[c.index(layer, part)], c.block_ids[layer], view)
                for i, layer, part, view in self._pack_steps]

    def _block_packer(self):
        """The one-launch packer (--pack-kernel cuda, blocks contiguous), made on first use;
        None: pack per (layer, part) (torch's index ops, or heads-major blocks)."""
        if not hasattr(self, "_packer"):
            self._packer = None
            c = self._cache
            if c is not None and c.pack_kernel == "cuda" and self._pack_steps:
                steps = self.block_steps()
                if all(pool[0].is_contiguous() for _, pool, _, _ in steps):
                    from kvbench.p2p.cuda_kernels import BlockPacker

                    self._packer = BlockPacker(steps)
        return self._packer

    def clear_staging(self) -> None:
        if self.packed:
            for b in self.buffers:
                b.zero_()


def plan_messages(data: KVCache | RawBuffer, granularity: str) -> MessagePlan:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity}")
    if isinstance(data, RawBuffer):
        if granularity != "whole":
            raise ValueError("--bytes sweeps move one message per handoff: use --granularity whole")
        return MessagePlan([data.backing], [-1])
    s = data.spec
    L, P = s.model.layers, s.parts
    if s.layout == "contiguous":
        if granularity == "whole":
            return MessagePlan([as_bytes(data.backing)], [-1], _cache=data)
        if granularity == "layer":
            return MessagePlan([as_bytes(t) for t in data.tensors],
                               [i // P for i in range(len(data.tensors))], _cache=data)
        bufs, layers = [], []
        for idx, t in enumerate(data.tensors):
            for a in range(0, t.shape[0], s.block_size):
                bufs.append(as_bytes(t[a:a + s.block_size]))
                layers.append(idx // P)
        return MessagePlan(bufs, layers, _cache=data)
    # paged
    if granularity == "block":
        bufs, layers = [], []
        for layer in range(L):
            for part in range(P):
                for blk in data.block_views(layer, part):
                    bufs.append(as_bytes(blk))
                    layers.append(layer)
        return MessagePlan(bufs, layers, _cache=data)
    pool0 = data.tensors[0]
    block_shape = tuple(pool0.shape[1:])
    sizes = [(layer, part, s.layer_blocks(layer)) for layer in range(L) for part in range(P)]
    total = sum(nb for _, _, nb in sizes) * pool0[0].numel()
    staging = empty(total, pool0.dtype, pool0.device)
    steps, off = [], 0
    views = []
    for layer, part, nb in sizes:
        n = nb * pool0[0].numel()
        views.append((layer, part, staging[off:off + n].view(nb, *block_shape)))
        off += n
    if granularity == "whole":
        steps = [(0, layer, part, v) for layer, part, v in views]
        return MessagePlan([as_bytes(staging)], [-1], True, steps, data)
    steps = [(i, layer, part, v) for i, (layer, part, v) in enumerate(views)]
    return MessagePlan([as_bytes(v) for _, _, v in views], [layer for layer, _, _ in views],
                       True, steps, data)
