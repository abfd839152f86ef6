"""Pattern registry: a handoff shape is a module here that decorates its class with
`@register` (sequential, layerwise, sharded, ...)."""

from __future__ import annotations

from kvbench.p2p.patterns.base import Pattern
from kvbench.p2p.registry import Registry

_registry: Registry[Pattern] = Registry("pattern", __name__, __path__)
register = _registry.register
available = _registry.available
get = _registry.get
