"""Snapshot triggers on scripted step sequences."""
from __future__ import annotations

import pytest

from recorders.triggers import StepHealth, Triggers

NAN, INF = float("nan"), float("inf")


def ok(scale=None, loss=1.0):
    return StepHealth(loss, True, scale)


def overflow(scale=65536.0, loss=1.0):
    return StepHealth(loss, False, scale)


@pytest.mark.parametrize(
    "steps, expected",
    [
        # A NaN loss fires once, when it starts; it re-arms after a finite step.
        ([ok(), StepHealth(NAN, True, None), StepHealth(NAN, True, None), ok(), StepHealth(INF, True, None)],
         [None, "nonfinite_loss", None, None, "nonfinite_loss"]),
        # Without a scaler, non-finite grads are a failure of their own.
        ([ok(), StepHealth(1.0, False, None)], [None, "nonfinite_grads"]),
        # With a scaler, one overflow is routine (GradScaler skips the step and backs off).
        ([ok(8.0), overflow(8.0), ok(4.0)], [None, None, None]),
        # The scale falling below min_scale (1.0) fires on the step it first does.
        ([ok(2.0), ok(1.0), ok(0.5), ok(0.25), ok(2.0), ok(0.5)],
         [None, None, "scale_collapse", None, None, "scale_collapse"]),
        # A loss of None (the loop did not pass one) is not a failure.
        ([StepHealth(None, True, None)], [None]),
        # Both the loss and the grads fail on one step: the loss names the snapshot.
        ([StepHealth(NAN, False, None)], ["nonfinite_loss"]),
    ],
)
def test_each_reason_fires_on_the_step_its_condition_starts(steps, expected):
    t = Triggers(min_scale=1.0, streak=8, max_snapshots=10)
    assert [t.check(h) for h in steps] == expected


def test_overflow_streak_fires_when_the_run_of_skipped_steps_after_the_scale_settled_reaches_its_length():
    t = Triggers(streak=3, max_snapshots=10)
    seq = [ok(65536.0), overflow(), overflow(), overflow(), overflow(), ok(65536.0), overflow(), overflow(), overflow()]
    # the 3rd consecutive overflow (index 3) fires; the 4th continues the same streak; after a
    # healthy step the count restarts, so index 8 is the next 3rd-in-a-row.
    assert [t.check(h) for h in seq] == [None, None, None, "overflow_streak", None, None, None, None,
                                         "overflow_streak"]


def test_start_up_calibration_skips_never_count_toward_overflow_streak():
    # GradScaler's default 65536 backing off 12 times before its first clean step (scale 16), then
    # three real overflows: only the streak after the scale settled counts.
    t = Triggers(streak=3, max_snapshots=10)
    calibration = [overflow(2.0 ** (16 - i)) for i in range(12)]
    seq = calibration + [ok(16.0), overflow(16.0), overflow(8.0), overflow(4.0)]
    assert [t.check(h) for h in seq] == [None] * 15 + ["overflow_streak"]


def test_skips_at_a_scale_of_one_or_below_are_not_calibration():
    # from the first step at scale <= 1 the gradients overflow unscaled: a failure, whatever came before
    t = Triggers(min_scale=0.0, streak=2, max_snapshots=10)
    seq = [overflow(4.0), overflow(2.0), overflow(1.0), overflow(0.5)]
    assert [t.check(h) for h in seq] == [None, None, None, "overflow_streak"]


def test_at_most_max_snapshots_fire_per_run():
    t = Triggers(max_snapshots=2)
    seq = [StepHealth(NAN, True, None), ok()] * 5
    fired = [r for r in (t.check(h) for h in seq) if r]
    assert fired == ["nonfinite_loss", "nonfinite_loss"]  # five NaN starts, limit 2
    assert t.exhausted


def test_holding_lists_every_condition_even_when_no_snapshot_fires():
    t = Triggers(max_snapshots=0)
    assert t.check(StepHealth(NAN, False, 0.5)) is None
    assert t.holding == ["nonfinite_loss", "scale_collapse"]


@pytest.mark.parametrize("kwargs, field", [
    ({"min_scale": -1.0}, "min_scale"),
    ({"streak": 0}, "overflow_streak"),
    ({"max_snapshots": -1}, "max_snapshots"),
])
def test_bad_trigger_settings_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Triggers(**kwargs)
