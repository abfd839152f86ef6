"""Transport registry. A transport is a module in this package that decorates its class
with `@register`; adding one is a new file, not an edit across the harness.

The class is also the transport's declaration (kvbench.p2p.transports.base.Transport, the
hooks at its end): its flags and their checks, its record fields, its descriptor count and
the link its records name. The functions below are how the rest of kvbench reads those
without naming any transport: the fit, the matrix and the report classify a record's link
through `classify_record`, the plan counts descriptors through `declared(...).descriptors`.
Importing the registry imports every transport module, none of which imports torch or mpi4py
at module level (base.py says why), so these work on an install without the `p2p` extra.
"""

from __future__ import annotations

from kvbench.links import linkpath
from kvbench.p2p.registry import Registry
from kvbench.p2p.transports.base import Transport

_registry: Registry[Transport] = Registry("transport", __name__, __path__, also="auto")
register = _registry.register
available = _registry.available
get = _registry.get


def declared(name: str) -> type[Transport] | None:
    """The transport class registered as `name`, or None (a record of a transport this
    install does not have: the link module's rules for old records read it)."""
    return available().get(name)


def link_rules() -> dict[str, linkpath.LinkRule]:
    """Transport name -> its `link_path` hook, for every installed transport."""
    return {name: cls.link_path for name, cls in available().items()}


def classify(transport: str, info: dict | None,
             pair: linkpath.PairFacts | None = None) -> linkpath.LinkPath:
    """The link a record of `transport` took, from its `transport_info` (and its pair's facts)."""
    rule = link_rules().get(transport, linkpath.by_path)
    return rule(info or {}, pair or linkpath.PairFacts())


def classify_record(rec) -> linkpath.LinkPath:
    """linkpath.classify_record with every installed transport's own rule."""
    return linkpath.classify_record(rec, link_rules())
