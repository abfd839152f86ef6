"""Serving SLO analysis: equal-budget benchmark plans, gates, capacity, scrapes, engine metrics.

Run `python -m kvbench.slo --help` (or `kvbench slo --help`); docs/slo.md has the details.
The per-request records and their metrics live one layer down, in kvbench.records
(requests.py, request_metrics.py), because the pandas readers need them too.

May import: units, cli, model, records, fit, plan. Never lab or report.
"""
