"""`python -m kvbench.fit`: setup_ms and effective GB/s fitted to measured samples.

    data.py      stream p2p records into per-group columns (link groups, not-link reasons)
    stats.py     the weighted line, round/block bootstrap, lack-of-fit
    regimes.py   two-regime (BIC) detection
    fitting.py   one group's fit, warnings, the kvbench.fit/2 document and its table
    plots.py     the fit's figure (matplotlib)
    sim.py       simulated runs with known truth (coverage checks and benchmarks)
    cli.py       flags and the command

May import: kvbench.units, kvbench.errors, kvbench.records, kvbench.links.linkpath (link names),
kvbench.kv.geometry (tokens -> bytes), kvbench.p2p.transports (each transport's torch-free link rule:
classify_record).
Never plan, slo, lab or report.
"""
