"""Mooncake's Transfer Engine as a kvbench transport (docs/mooncake.md).

Modules: libs (finding the wheel and a private copy of the Debian libraries its binaries
need, without changing the system), transport (`--transport mooncake`: the flags, the
engine, the channel). `python -m kvbench.p2p.transports.mooncake fetch-libs` makes the
private copy. Importing this package registers the transport; `mooncake` itself is
imported lazily, so the registry works without the package.
"""

from kvbench.p2p.transports.mooncake import transport  # noqa: F401  (it registers)
