"""kvbench.fit.batch fits the groups of one layout at once (issue 44 item 3: a million matrix
pairs): every record must be what fit_group gives that group, the same dict, floats and draws
equal to the last bit (not within a tolerance: the batched path makes the same numpy and LAPACK
calls on stacked arrays, and squares Python floats with the C library's pow as fit_group does).
Planted stacks: two and three sizes, noise, ties, constant times, a negative slope, too few
rounds, blocks of different lengths, six sizes with and without a second regime, empty and
not-a-link groups, all mixed in one list. A planted fault (one pair's times moved by one ulp
after stacking) must be caught by the same comparison."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.errors import UsageError
from kvbench.fit import batch
from kvbench.fit.data import group_records
from tests.fit.helpers import fit_each
from tests.helpers import SPEC, rounds_records

MB = 1 << 20
BOOT, SEED = 300, 7


def diff(a, b, path="record") -> list[str]:
    """Where a and b differ (types included: a float is not a numpy float); [] when equal."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diff(x, y, f"{path}[{i}]")]
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        return [] if same else [f"{path}: arrays differ"]
    if isinstance(a, UsageError):
        return [] if str(a) == str(b) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def reference(groups, raw_draws):
    return fit_each(groups, BOOT, SEED, raw_draws)


def pair_records(i, sizes, *, rounds=20, rate=1.0, seed=0, fn=None, **kw):
    spec = dict(SPEC, variant=f"pair-{i}")
    recs = rounds_records(sizes, 1.0, rate, rounds=rounds, seed=seed, spec=spec, **kw)
    for r in recs:
        if fn is not None:
            r["samples_ms"] = [float(v) for v in fn(r["bytes"], np.asarray(r["samples_ms"]))]
    return recs


def planted(k_sizes: int, n: int, start: int = 0, **kw) -> list[dict]:
    """n pairs of one layout: noisy ones, ties (times on a 0.05 ms grid), constant times, a
    negative slope, a slow pair."""
    sizes = [MB * 4 ** j for j in range(k_sizes)]
    fns = [None, lambda b, v: np.round(v / 0.05) * 0.05, lambda b, v: np.full_like(v, 5.0),
           lambda b, v: v * 0 + 20.0 - b / MB * (1 + 0.01 * np.arange(len(v)) % 3),
           lambda b, v: v * 20]
    out = []
    for i in range(n):
        out += pair_records(start + i, sizes, seed=start + i, fn=fns[i % len(fns)],
                            rate=0.5 + i % 7, **kw)
    return out


def check(records, raw_draws=True, expect_batched=None):
    groups = group_records(records)
    got = batch.fit_groups_batched(groups, BOOT, SEED, raw_draws)
    want = reference(groups, raw_draws)
    assert len(got) == len(want)
    bad = [d for g, w in zip(got, want, strict=True) for d in diff(g, w)]
    assert not bad, bad[:5]
    return groups, got


@pytest.mark.parametrize("k_sizes", [2, 3])
@pytest.mark.parametrize("raw_draws", [True, False])
def test_planted_stacks_fit_as_fit_group_fits_them(k_sizes, raw_draws):
    check(planted(k_sizes, 12), raw_draws)


def test_the_stacks_are_fitted_batched_not_passed_through(monkeypatch):
    """The equality above means something only if the batched path did the fitting: count
    the groups it hands to fit_group."""
    passed = []
    real = batch._one
    monkeypatch.setattr(batch, "_one", lambda g, *a: passed.append(g.label) or real(g, *a))
    check(planted(2, 10) + planted(3, 10, start=100))
    assert passed == []


def test_a_mixed_list_with_groups_that_must_fall_back(monkeypatch):
    recs = planted(2, 6) + planted(3, 6, start=50)
    recs += pair_records(200, [MB, 4 * MB], rounds=5)  # too few rounds: no interval
    recs += pair_records(201, [MB, 4 * MB], rounds=5, seed=3)
    recs += pair_records(202, [4 * MB])  # one size
    recs += pair_records(203, [MB, 4 * MB], fn=lambda b, v: v * 0)  # zero times: no_rate
    wrong = pair_records(204, [MB, 4 * MB])
    for r in wrong:
        r["wrong"] = 3  # every record wrong: no samples, fit_group raises
    loop = pair_records(205, [MB, 4 * MB], seed=9)
    for r in loop:
        r["fit_as_link"], r["not_link_reason"] = False, "loopback: no link measured"
    recs += wrong + loop
    recs += planted(2, 3, start=300)  # the first layout again, after the others
    extra = pair_records(206, [MB, 4 * MB], seed=11)
    extra.insert(1, dict(extra[0], wrong=5))  # one record excluded: the layout of the others
    recs += extra
    passed = []
    real = batch._one
    monkeypatch.setattr(batch, "_one", lambda g, *a: passed.append(g.spec["variant"])
                        or real(g, *a))
    groups, got = check(recs)
    assert sorted(passed) == [f"pair-{i}" for i in (200, 201, 203, 204, 205)]
    codes = [w["code"] for w in got[[g.spec["variant"] for g in groups].index("pair-206")]
             ["warnings"]]
    assert "excluded_wrong" in codes
    assert isinstance(got[[g.spec["variant"] for g in groups].index("pair-204")], UsageError)


def test_six_sizes_with_and_without_two_regimes(monkeypatch):
    """Six sizes: a straight pair is fitted batched; a pair with a knee, where fit_group looks
    for two regimes, goes through fit_group."""
    sizes = [MB * 2 ** j for j in range(6)]
    knee = lambda b, v: v * np.where(b > 4 * MB, 3.0, 1.0)  # noqa: E731
    recs = pair_records(0, sizes, seed=1) + pair_records(1, sizes, seed=2, fn=knee)
    passed = []
    real = batch._one
    monkeypatch.setattr(batch, "_one", lambda g, *a: passed.append(g.spec["variant"])
                        or real(g, *a))
    _, got = check(recs)
    assert passed == ["pair-1"] and got[1]["two_regimes"] is not None


@pytest.mark.parametrize("lengths", [(6, 9, 12), (20, 30, 40)])
def test_blocks_of_different_lengths(monkeypatch, lengths):
    """order blocks, three runs of different lengths per size: the resampled multiset's size
    varies from draw to draw (the middle positions are per draw); 90 samples of a size take
    the path without the per-pair (i, j) table."""
    recs = []
    for i in range(4):
        for run, n in enumerate(lengths):
            for r in pair_records(i, [MB, 8 * MB], rounds=n, seed=10 * i + run,
                                  run_id=f"run-{run}"):
                r["order"], r["sample_rounds"] = "blocks", None
                recs.append(r)
    passed = []
    real = batch._one
    monkeypatch.setattr(batch, "_one", lambda g, *a: passed.append(g.label) or real(g, *a))
    check(recs)
    assert passed == []


def test_a_perturbed_pair_is_caught(monkeypatch):
    """Plant a fault: one pair's times each moved by one ulp after stacking (its medians and
    draws move by about one ulp). The comparison must name that pair's record and no other."""
    real = batch._summary

    def faulty(lay, ms):
        ms[0] = np.nextafter(ms[0], np.inf)
        return real(lay, ms)

    monkeypatch.setattr(batch, "_summary", faulty)
    groups = group_records(planted(2, 4))
    got = batch.fit_groups_batched(groups, BOOT, SEED, True)
    want = reference(groups, True)
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if diff(g, w)]
    assert bad == [0]


@pytest.mark.parametrize("k_sizes", [2, 3, 4, 5])
def test_many_random_pairs_in_chunks(monkeypatch, k_sizes):
    """150 pairs of random rates, setups and noise over six decades of time, fitted in chunks
    of 7 pairs: a last-bit difference anywhere (a sum taken in another order, a square taken
    as x * x) shows in some pair's draws or rounded fields. Times of 6 significant digits, as
    records hold them: a mean of such times often ends in a 5 at the 7th digit, where its
    last bit decides the rounding (this caught the batched means summed in another order)."""
    rng = np.random.default_rng(k_sizes)
    sizes = [MB * 8 ** j for j in range(k_sizes)]
    recs = []
    for i in range(150):
        scale = 10 ** rng.uniform(-3, 3)
        recs += [dict(r, samples_ms=[float(f"{v * scale:.6g}") for v in r["samples_ms"]])
                 for r in pair_records(
            i, sizes, seed=i, rate=10 ** rng.uniform(-1, 2), noise=rng.uniform(0.001, 0.2))]
    monkeypatch.setattr(batch, "CHUNK_ELEMS", BOOT * 7)
    check(recs)


@pytest.mark.parametrize("k_sizes", [2, 3])
def test_rounds_that_lack_a_size_drop_the_same_draws(monkeypatch, k_sizes):
    """The largest size timed in 3 of the 20 rounds only: a resample without those rounds has
    no median of that size and is dropped (about 4% of draws); the kept draws, and the
    scatter draws that follow them, must be fit_group's."""
    recs = []
    for i in range(8):
        spec_kw = {"seed": i, "rate": 1 + i}
        recs += pair_records(i, [MB * 4 ** j for j in range(k_sizes - 1)], **spec_kw)
        recs += pair_records(i, [MB * 4 ** (k_sizes - 1)], rounds=3, **spec_kw)
    passed = []
    real = batch._one
    monkeypatch.setattr(batch, "_one", lambda g, *a: passed.append(g.label) or real(g, *a))
    _, got = check(recs)
    assert passed == [] and 0 < got[0]["resampling"]["n_draws"] < BOOT
