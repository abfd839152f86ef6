"""`python -m kvbench.plan`: handoff floors, budget verdicts, routing and planner exports.

    floors.py    links read from a fit (or given), floors and 95% bands per prompt size
    route.py     local vs remote prefill: exposed handoff, interference, break-even
    export.py    `plan export`: Dynamo, AISimulate, BLIS, Splitwise, JSON
    cli.py       flags and the commands (plan, plan route, plan export)

May import: kvbench.units, kvbench.cli, kvbench.model, kvbench.records, kvbench.fit.
Never slo, lab or report.
"""
