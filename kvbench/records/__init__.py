"""What runs write and how every file is read back.

    write.py            the atomic, never-overwriting writer; the environment a record carries
    schema/             typed, bounded readers of every input (pydantic): p2p records, fits,
                        SLO records, plans, HF configs, metric scrapes
    requests.py         per-request SLO records (kvbench.slo.request/1): parse, stream, write
    request_metrics.py  what a request record means: TTFT, TPOT, ITL, E2E per request
    frames/             every result file as a pandas DataFrame (kvbench.results.load)
    stats.py            percentiles and the sample counts that support them
    select.py           --where parsing and matching, not-a-link reasons (fit, plan, slo)

May import: kvbench.units, kvbench.errors. Never p2p, fit, plan, slo, lab or report: every
layer above reads and writes through this one (tests/test_layout.py keeps it so).
"""
