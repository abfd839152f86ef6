"""Helpers the matrix tests share: the sizes, the interfaces' path strings, and the p2p records
of one matrix run with a planted slow pair or odd path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvbench.p2p.patterns.matrix import ordered_pairs
from kvbench.records.schema.p2p import HandoffSpec
from tests.helpers import rounds_records

MB = 1 << 20
ETH1 = "UCX RMA write: tcp/eth1 (zero-copy); notifications (AM): tcp/eth1"
HOSTS = ["n1", "n2", "n3"]


SIZES = [1 * MB, 2 * MB, 4 * MB, 8 * MB]


ETH0 = "UCX RMA write: tcp/eth0 (zero-copy); notifications (AM): tcp/eth0"


def matrix_records(rates: dict, paths: dict | None = None, *, hosts=HOSTS, wrong=None,
                   transport="nixl", seed=0) -> list[dict]:
    """The records of one matrix run: every ordered pair of len(hosts) ranks at its rate (GB/s,
    1 ms setup), in 12 interleaved rounds, naming its pair and its path as kvbench p2p does."""
    n, out = len(hosts), []
    for k, (s, r) in enumerate(ordered_pairs(n)):
        spec = HandoffSpec(transport=transport, pattern="matrix", granularity="whole",
                           layout="raw", device="cpu", hosts=list(hosts), variant=f"{s}->{r}",
                           world={"size": n, "prefill_ranks": [s], "decode_ranks": [r]}).as_dict()
        path = (paths or {}).get((s, r), ETH0)
        out += rounds_records(
            SIZES, 1.0, rates.get((s, r), 1.0), rounds=12, seed=seed + k, spec=spec,
            run_id="run-m", transport=transport, pattern="matrix", variant=f"{s}->{r}",
            world_size=n, hosts=list(hosts), pair=[s, r],
            sender={"rank": s, "host": hosts[s]}, receiver={"rank": r, "host": hosts[r]},
            schedule={"name": "rounds", "round": k, "rounds": n * (n - 1),
                      "pairs_in_round": [[s, r]]},
            wireup_ms=2.0, transport_info={"path": path, "path_source": "test"},
            wrong=(wrong or {}).get((s, r), 0))
    return out


PLANTED = {(1, 0): 0.05}  # n2 -> n1: 5% of the others' rate


ODD = {(0, 2): ETH1}  # n1 -> n3 over another interface


def matrix_scale_module():
    """benchmarks/matrix_scale.py as a module: its synthetic N-rank records, written as a
    real job writes them (planted slow pairs and an odd path)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "matrix_scale.py"
    spec = importlib.util.spec_from_file_location("matrix_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synthetic_matrix_file(folder: Path, n: int, per_node: int, rounds: int, *, seed: int) -> Path:
    """The records file of benchmarks/matrix_scale.py's synthetic n-rank job, in `folder`."""
    from kvbench.records.write import write_records

    src, _ = write_records(folder, list(matrix_scale_module().records(n, per_node, rounds,
                                                                      seed=seed)), "kvbench-p2p")
    return src


def assert_same_document(new, new_draws: list, old, old_draws: list, planted: dict) -> None:
    """Two matrix documents of one run the same (but for when each was made), their draws
    files equal to the last bit, and exactly the planted pairs named, each with its code."""
    import numpy as np

    drop = {"created"}
    assert new.model_dump(exclude=drop) == old.model_dump(exclude=drop)
    assert np.array_equal(new_draws[0], old_draws[0])
    named = {tuple(p.pair): [f.code for f in p.findings] for p in new.pairs if p.findings}
    assert named == {p: [c] for p, c in planted.items()}
