"""Serving SLO analysis: equal-budget benchmark plans, per-request records, gates and capacity.

Run `python -m kvbench.slo --help` (or `kvbench slo --help`); docs/slo.md has the details.
"""

from __future__ import annotations

from kvbench.slo.cli import cli, main

__all__ = ["cli", "main"]
