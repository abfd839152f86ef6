"""A pattern's spec entries are typed (kvbench.p2p.patterns.base.SpecEntries): the CLI builds
every record's spec from the run's entries and these, never from a pattern's record keys."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbench.p2p.patterns.base import Pattern, SpecEntries
from kvbench.p2p.spec import make_spec

RUN = {"transport": "mpi", "transport_options": {"path": "host"}, "layout": "paged",
       "device": "cpu", "hosts": ["a", "a", "b"], "block_size": 16, "dtype": "bf16",
       "model": "llama-3.1-8b"}


class Two(Pattern):
    name = "two"

    def bytes_per_rank(self, point):
        return 0

    def setup(self, point):
        raise NotImplementedError


class Own(Two):
    def spec_fields(self) -> dict:
        return {"compute": {"layer_compute": "ms"}, "layer_poll": False}


class Undeclared(Two):
    def spec_fields(self) -> dict:
        return {"colour": "blue"}  # not a spec entry: refused, not written


def pattern(cls):
    return cls(SimpleNamespace(args=SimpleNamespace(pack_kernel="cuda")))


def test_entries_carry_roles_pack_kernel_and_the_patterns_own():
    e = pattern(Own).entries("block", variant="v", packed=True, block_size=4, pair=(2, 0))
    assert (e.prefill_ranks, e.decode_ranks, e.pack_kernel) == ([2], [0], "cuda")
    assert (e.compute, e.layer_poll) == ({"layer_compute": "ms"}, False)
    plain = pattern(Two).entries("whole")
    assert (plain.prefill_ranks, plain.decode_ranks, plain.pack_kernel) == ([0], [1], None)


def test_a_pattern_entry_that_is_not_a_spec_field_is_refused():
    with pytest.raises(TypeError, match="colour"):
        pattern(Undeclared).entries("whole")


def test_the_points_block_size_replaces_the_runs_only_on_a_paged_run():
    e = SpecEntries("block", [0], [1], block_size=4)
    assert make_spec(RUN, "two", e).block_size == 4
    assert make_spec({**RUN, "layout": "raw", "block_size": None}, "two", e).block_size is None
    assert make_spec(RUN, "two", SpecEntries("block", [0], [1])).block_size == 16


def test_the_world_is_one_rank_per_host_and_a_spec_without_a_cut_has_no_cut_key():
    spec = make_spec(RUN, "two", SpecEntries("whole", [0], [1, 2]))
    assert spec.world.size == 3 and "cut" not in spec.as_dict()
