"""The engine-shaped handoff's side files (--block-ids file:PATH, an engine
profile's poll=draw:PATH) read through a typed, bounded model (kvbench.records.schema.engine), like every
other input file.

Each hostile file the third hostile round tried is refused in one line naming the file (and
the key) where it was a traceback (a string, a null, a bool, a 5,000-digit id, 100,000-deep
nesting, values out of range) or was silently taken (a key given twice, NaN, an unknown key);
a block-id file with fewer ids than the largest request needs is refused at validation, on
every rank alike, instead of a traceback when the KV is allocated; a huge id sizes a pool the
memory check refuses before anything is allocated.
"""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from kvbench.cli import UsageError
from kvbench.kv import cut as kc
from kvbench.model import get_dtype, resolve_model
from kvbench.p2p.patterns.base import Point
from kvbench.p2p.transports.nixl import engine_shape as es
from tests.p2p.helpers import engine_args as _args

GOOD_IDS = {"prefill": [7, 3, 9], "decode": [0, 1, 2]}
BLOCKS = [  # (file text, what the one line must say)
    ('{"prefill": [0, 1, 2]}', "decode: missing"),
    ('{"prefill": [0, 1], "prefill": [5, 6], "decode": [0, 1]}', "duplicate key 'prefill'"),
    ('{"prefill": ["0", "1"], "decode": [0, 1]}', "prefill[0]: must be an integer"),
    ('{"prefill": null, "decode": [0, 1]}', "prefill: must be a list"),
    ('{"prefill": [0, true], "decode": [0, 1]}', "prefill[1]: must be an integer"),
    ('{"prefill": [0, NaN], "decode": [0, 1]}', "NaN is not a JSON number"),
    ('{"prefill": [0, 1.5], "decode": [0, 1]}', "prefill[1]: must be an integer"),
    ('{"prefill": [0, -1], "decode": [0, 1]}', "prefill[1]: must be >= 0"),
    ('{"prefill": [0, 2147483648], "decode": [0, 1]}', "prefill[1]: must be <= 2147483647"),
    ('{"prefill": [0, ' + "9" * 5000 + '], "decode": [0, 1]}', "integer with 5000 digits"),
    ('{"prefill": [0, 1], "decode": [4, 4]}', "block id 4 is listed twice"),
    ('{"prefill": [], "decode": [0, 1]}', "prefill: must have at least 1"),
    ('{"prefill": [0, 1], "decode": [0, 1], "extra": 1}', "extra: unknown key"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels"),
    ("[0, 1]", "expected an object with 'prefill' and 'decode'"),
    ('{"prefill": [0, 1], "dec', "not valid JSON"),
    ("", "not valid JSON"),
]
POLLS = [
    ("[1.0, NaN]", "NaN is not a JSON number"),
    ("[1.0, Infinity]", "Infinity is not a JSON number"),
    ("[1e400]", "out of range"),
    ("[]", "at least 1"),
    ('[1, "2"]', "[1]: must be a number"),
    ("[20000]", "[0]: must be <= 10000"),
    ('{"le_ms": [1, 2], "le_ms": [3, 4], "count": [1, 2]}', "duplicate key 'le_ms'"),
    ('{"le_ms": [1, null], "count": [1, 2]}', "le_ms[1]: must be a number"),
    ('{"le_ms": [1, 1e308], "count": [1, 2]}', "le_ms[1]: must be <= 100000"),
    ('{"le_ms": [-5, 2], "count": [1, 2]}', "le_ms[0]: must be > 0"),
    ('{"le_ms": [2, 1], "count": [1, 2]}', "bounds must ascend"),
    ('{"le_ms": [1, 2], "count": [2, 1]}', "cumulative counts never fall"),
    ('{"le_ms": [1, 2], "count": [0, 0]}', "no step was counted"),
    ('{"le_ms": [1, 2], "count": [true, 2]}', "count[0]: must be an integer"),
    ('{"le_ms": [1, 2], "count": [1]}', "one count per bound"),
    ('{"le_ms": [1, 2], "count": [1, ' + "9" * 400 + "]}", "integer with 400 digits"),
    ('"fast"', "expected a list of step times"),
]


def ids_refusal(kind: str, need: int = 1) -> str | None:
    """What validation says about --block-ids KIND for a request of `need` blocks (the cut's
    declaration reads the file; each side's table must hold the request)."""
    try:
        for c in kc.declared_cuts([16], None, kind, None, pages=True):
            for side in ("prefill", "decode"):
                kc.block_table(c.blocks, need, side)
    except (ValueError, UsageError) as exc:
        return str(exc)
    return None


def one_line_naming(message: str | None, path, fragment: str) -> None:
    assert message is not None, "accepted"
    assert "\n" not in message and str(path) in message and fragment in message, message


@pytest.mark.parametrize("text, fragment", BLOCKS, ids=[f"blocks-{i}" for i in range(len(BLOCKS))])
def test_a_bad_block_id_file_is_one_line_at_validation(tmp_path, text, fragment):
    f = tmp_path / "ids.json"
    f.write_text(text)
    one_line_naming(ids_refusal(f"file:{f}"), f, fragment)


@pytest.mark.parametrize("text, fragment", POLLS, ids=[f"poll-{i}" for i in range(len(POLLS))])
def test_a_bad_poll_file_is_one_line_at_validation(tmp_path, text, fragment):
    f = tmp_path / "steps.json"
    f.write_text(text)
    one_line_naming(es.usage_error(_args(nixl_poll=f"draw:{f}")), f, fragment)


def test_good_side_files_are_read_and_a_missing_one_named(tmp_path):
    f = tmp_path / "ids.json"
    f.write_text(json.dumps({**GOOD_IDS, "meta": {"engine": "vllm 0.32.0"}}))
    assert ids_refusal(f"file:{f}", need=3) is None
    g = tmp_path / "steps.json"
    g.write_text(json.dumps({"le_ms": [1, 5, 25], "count": [0, 10, 10]}))
    assert es.usage_error(_args(nixl_poll=f"draw:{g}")) is None
    g.write_text("[2, 3.5]")  # integers are step times too
    assert es.PollSchedule(f"draw:{g}").samples == [2.0, 3.5]
    one_line_naming(ids_refusal(f"file:{tmp_path / 'no.json'}"), tmp_path / "no.json",
                    "no such block-id file")


def test_too_few_ids_for_the_largest_request_are_refused_at_validation(tmp_path):
    """The check used one block; the allocation then needed the request's (a traceback on a
    rank). validate() now passes the largest request's block count."""
    from kvbench.p2p.args import build_parser, validate

    f = tmp_path / "ids.json"
    f.write_text(json.dumps({"prefill": list(range(40)), "decode": list(range(5))}))
    args = build_parser(0).parse_args(["--transport", "nixl", "--nixl-engine-profile", "vllm-0.32", "--layout",
                                       "paged", "--granularity", "block", "--sizes", "16,600",
                                       "--block-ids", f"file:{f}"])
    with pytest.raises(UsageError) as err:
        validate(args, 2)
    one_line_naming(str(err.value), f, "decode: lists 5 block ids, the largest request (--sizes) needs 38")


@pytest.mark.parametrize("side, rank", [("prefill", 0), ("decode", 1)])
def test_a_huge_id_sizes_the_pool_the_memory_check_sees(tmp_path, side, rank):
    """A recorded id of 2^31 - 1 made KVCache allocate 2^31 blocks per layer (488 GiB tried);
    the estimate the memory check compares with MemAvailable now counts that pool."""
    from kvbench.p2p.patterns.sequential import estimate_bytes

    f = tmp_path / "ids.json"
    f.write_text(json.dumps({**GOOD_IDS, side: [2**31 - 1, 0, 1]}))
    model = resolve_model(None, None)
    ctx = Namespace(args=_args(block_size=16), model=model, dtype=get_dtype("bf16"), rank=rank)
    huge = Point(prompt_tokens=40, cut=kc.Cut(16, "joint", f"file:{f}"))
    small = Point(prompt_tokens=40, cut=kc.Cut(16, "joint", "contiguous"))
    per_block = model.layers * 2 * 16 * model.kv_heads * model.head_dim * 2
    assert estimate_bytes(ctx, huge, "block") >= 2**31 * per_block
    assert estimate_bytes(ctx, small, "block") < 10 * per_block + 2**24


def test_the_step_times_kvbench_lab_writes_are_read(tmp_path):
    """kvbench reads what kvbench writes: lab agree turns vLLM's inter-token histogram (bounds
    10 ms .. 80 s, a +Inf bucket, a "source" key) into the poll file p2p draws from."""
    from kvbench.lab.agree.engine import step_draws

    bounds = [10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 400.0, 500.0, 750.0, 1000.0,
              2500.0, 5000.0, 7500.0, 10000.0, 20000.0, 40000.0, 80000.0]
    fractions = [0.5, 0.3, 0.1] + [0.005] * (len(bounds) - 3)
    itl = {"count": 1000, "buckets": [[b, f] for b, f in zip(bounds, fractions, strict=True)]
           + [["+Inf", 1 - sum(fractions)]]}
    f = tmp_path / "steps-2rps.json"
    f.write_text(json.dumps(step_draws(itl)) + "\n")
    assert es.usage_error(_args(nixl_poll=f"draw:{f}")) is None
    assert 0 <= es.PollSchedule(f"draw:{f}").next_ms() <= 80000.0
