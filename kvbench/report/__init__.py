"""`kvbench report RESULTS_DIR`: one Markdown + HTML summary of a results folder.

    data.py       files found and read (p2p records, samples, fits, SLO reports)
    checks.py     warnings: busy machine, mixed configurations, fits that do not hold
    sections.py   environment, per-size tables, refits with plots
    doc.py        Markdown and self-contained HTML
    cli.py        flags and the command

May import anything below it: units, cli, model, records, kv, links, fit, plan, slo.
Nothing imports it.
"""
