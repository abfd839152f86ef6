"""Transport registry. A transport is a module in this package that decorates its class
with `@register`; adding one is a new file, not an edit across the harness."""

from __future__ import annotations

from kvbench.p2p.registry import Registry
from kvbench.p2p.transports.base import Transport

_registry: Registry[Transport] = Registry("transport", __name__, __path__, also="auto")
register = _registry.register
available = _registry.available
get = _registry.get
