"""One typed schema layer for every file kvbench reads, and the one contract of every file
format kvbench writes (writers dump through the same classes: docs/contracts.md).

    read.py       bounded readers: file size, JSON (depth, huge integers, NaN/Infinity,
                  duplicate keys), JSON Lines streamed one line at a time, YAML without
                  aliases, anchors or complex keys
    types.py      strict, finite, physically bounded field types and the one-line message
    hf_config.py  Hugging Face config.json (the fields that size the KV cache)
    slo.py        SLO request records, vLLM bench results, metric scrapes, mapping files
    p2p.py        a kvbench.p2p/1 result record (fields of docs/contracts.md section 1 included)
    fit.py        a kvbench.fit/2 (and /1) document (the groups plan and export read)
    plan.py       kvbench.plan/1, kvbench.route/1 and kvbench.kv-transfer-model/1 (plan export)
    matrix.py     a kvbench.matrix/1 document (kvbench matrix), and one pair of it as a fit
    clients.py    AIPerf and GuideLLM exports (the fields slo convert reads)
    engine.py     the engine-shaped handoff's block-id and poll (step-time) files

Every problem is one line: FILE[:LINE]: KEY.PATH: what was expected, got VALUE.
Limits and exit codes: docs/robustness.md.
"""
