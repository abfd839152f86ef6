"""`python -m kvbench.plan`: handoff floors, budget verdicts, routing and planner exports.

    floors.py    FittedLink (a fit group read through its contract, or a rate given), floors
                 and 95% bands per prompt size
    route.py     local vs remote prefill: exposed handoff, interference, break-even
    descriptors.py  the per-descriptor term: count, time, smallest block size within budget
    export.py    `plan export`: the kv-transfer model, then Dynamo, AISimulate, BLIS, Splitwise
    cli.py       flags and the commands (plan, plan route, plan export)

May import: kvbench.units, kvbench.errors, kvbench.cli (cli.py only), kvbench.model,
kvbench.records (a fit is read through its contract and the selectors of records.select, not
through kvbench.fit), and the pure KV vocabulary: kvbench.kv.geometry (tokens -> bytes),
kvbench.kv.cut / kvbench.kv.shards (counting; no torch, no MPI),
and the transports' torch-free declarations (kvbench.p2p.transports: how each counts descriptors).
Never slo, lab or report.
"""
