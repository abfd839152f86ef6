"""Choosing records and fitted groups: `--where KEY=VALUE` parsing and matching, the sample
count a percentile needs, and why a record's time is not bytes over a link.

Why in records: fit groups records by these rules, and plan and slo pick fitted groups by
the same ones; each of them reads records, so the rules live where the records are read,
not in fit (plan and slo would otherwise reach sideways into fit for a parser).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbench.errors import UsageError
from kvbench.records.stats import min_samples_for  # noqa: F401 (one import place for the selectors)

# pure transfers measured inside a layerwise run: its only variants that are a link
LAYERWISE_LINK_VARIANTS = ("xfer", "seq")


def parse_where(items: Sequence[str] | None) -> dict[str, str]:
    """`--where KEY=VALUE` flags (repeatable) as {key: value}; a malformed one is one line."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--where expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _as_text(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return "null" if v is None else str(v)


def matches(group: dict, where: dict[str, str]) -> bool:
    """Whether a group's fields equal every --where value, compared as the user typed them
    (a list as "a,b", None as "null")."""
    return all(_as_text(group.get(k)) == v for k, v in where.items())


def not_link_reason(rec: dict) -> str | None:
    """Why a record's time is not bytes over a link, or None when it is a link."""
    if rec.get("bytes") == 0:
        return "zero bytes (compute only)"
    if "fit_as_link" in rec:
        if rec.get("fit_as_link") is False:
            return str(rec.get("not_link_reason") or "declared not a link by its pattern")
        return None
    pattern, variant = rec.get("pattern"), rec.get("variant")
    if pattern == "layerwise" and variant not in LAYERWISE_LINK_VARIANTS:
        what = "overlapped handoff" if variant is None else f"variant '{variant}'"
        return f"layerwise {what} includes the sender's compute"
    if pattern == "sharded" and variant == "isolated":
        return ("sharded isolated: bytes summed over edges, time a maximum over edges run "
                "separately (a rate never observed)")
    return None
