"""The verdict, fix and probe registries hold their entries in the order their ``ORDER`` lists say,
whatever order the entries are registered (imported) in; an entry not listed comes after, as registered."""
from __future__ import annotations

import random

import pytest

from analyzer.replay import FIXES, PROBES, VERDICTS
from analyzer.replay.fixes import registry as fixes
from analyzer.replay.verdicts import registry as verdicts
from analyzer.replay.probes import registry


@pytest.mark.parametrize("registry_, order", [(VERDICTS, verdicts.ORDER), (FIXES, fixes.ORDER),
                                               (PROBES, registry.ORDER)])
def test_the_built_in_entries_are_exactly_the_listed_ones_in_the_listed_order(registry_, order):
    assert tuple(registry_) == order


@pytest.mark.parametrize("seed", range(5))
def test_registering_in_any_order_gives_the_listed_order_then_the_unlisted_as_registered(seed):
    names = list(fixes.ORDER) + ["extra_b_test", "extra_a_test"]
    shuffled = names[:]
    random.Random(seed).shuffle(shuffled)
    reg: dict[str, int] = {}
    for n in shuffled:
        reg[n] = 0
        verdicts.in_order(reg, fixes.ORDER)
    unlisted = [n for n in shuffled if n.startswith("extra_")]
    assert list(reg) == list(fixes.ORDER) + unlisted


def test_a_probe_outside_the_order_runs_after_the_listed_ones():
    @registry.probe("late_test")
    def late(_inp):
        return None

    try:
        assert [p.name for p in registry._ordered()] == [*registry.ORDER, "late_test"]
    finally:
        PROBES.pop("late_test")
