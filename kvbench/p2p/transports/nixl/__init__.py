"""NIXL with its UCX backend: the KV-transfer path of current disaggregated serving stacks.

One NIXL agent per rank. A channel registers the memory behind its messages (the KV's
backing allocations, as an engine registers its cache tensors), exchanges agent metadata
and serialized descriptor lists with its peer over MPI (no etcd, no listener thread), and
prepares one descriptor per message: per layer tensor, per paged block, or one for the
whole KV, following the message plan.

    --nixl-op write  prefill (initiator) WRITEs into decode's registered buffers; decode
                     learns completion from the notification NIXL sends after the data.
    --nixl-op read   prefill announces each ready message with a notification; decode
                     (initiator) READs it; prefill learns completion from the READ's
                     notification, decode from its own transfer state.

Modes: reuse everything (default: registrations, prepared lists and transfer requests made
once per channel, reposted every handoff), --nixl-recreate (a new transfer request per
handoff), --nixl-reregister (register, exchange metadata, prepare and create per handoff,
deregister after it). The per-handoff costs of the last two sit inside the timed handoff.

Set-up and per-handoff costs come out of `breakdown()` (see docs/nixl.md). `info()` records
the UCX variables in force and the protocols UCX itself reports it selected (UCX_PROTO_INFO,
read from a private log file unless the user set UCX_PROTO_INFO or UCX_LOG_FILE).

`nixl` is imported lazily, so the registry works without the package.

Modules: binding (finding NIXL's Python package, its limits, an agent with a progress
delay), channel (one prefill/decode pair: registration, metadata exchange over MPI, posts,
notifications), transport (the flags, the agent, what the record says about the path),
engine (--nixl-engine-profile: vLLM's pull connector's shape). Importing this package
registers the transport; the engine shape (which needs torch) registers its channel when a
run asks for it (NIXLTransport.channel), so the registry reads NIXL's declaration without
torch (kvbench.p2p.registry.LazyModule). May import kvbench.cli and kvbench.p2p.
"""

from kvbench.p2p.transports.nixl import transport  # noqa: F401  (it registers)
