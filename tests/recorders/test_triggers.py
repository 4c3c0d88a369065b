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


# -- spikes: scripted sequences through the same Triggers.check the recorder calls ---------------------
from recorders._spikes import SpikeWatch, warmup_of  # noqa: E402


def _noisy(n, level=1.0, seed=0, sd=0.05):
    """`n` healthy values around `level`: multiplicative noise of log-sd about `sd` (deterministic)."""
    import random

    r = random.Random(seed)
    return [level * (1 + sd * r.uniform(-1.7, 1.7)) for _ in range(n)]


def _spiky(window=20, loss_factor=3.0, grad_factor=10.0, cap=5):
    return Triggers(max_snapshots=10, spikes=SpikeWatch(loss_factor=loss_factor, grad_factor=grad_factor,
                                                        window=window), max_spike_snapshots=cap)


def _run(t, losses, grads=None):
    grads = grads if grads is not None else [1.0] * len(losses)
    return [t.check(StepHealth(x, math.isfinite(g) if g is not None else True, None, g)) for x, g in zip(losses, grads)]


import math  # noqa: E402

W = 20  # the window of these sequences; warm-up: max(10, W // 2) = 10 values


@pytest.mark.parametrize(
    "losses, grads, fires",
    [
        # a loss 5x its median after the warm-up: loss_spike on that step, and only there
        (_noisy(15) + [5.0] + _noisy(10, seed=1), None, {15: "loss_spike"}),
        # the same jump before the baseline holds warm-up values: nothing
        (_noisy(5) + [5.0] + _noisy(10, seed=1), None, {}),
        # 2.5x: below the factor 3, however quiet the baseline
        (_noisy(15) + [2.5] + _noisy(10, seed=1), None, {}),
        # a jump that stays high: one snapshot at its start (edge), none while it holds
        (_noisy(15) + [6.0] * 15, None, {15: "loss_spike"}),
        # a loss that climbs steadily, 5% a step: never 3x its trailing median
        ([1.05 ** i for i in range(40)], None, {}),
        # noisy losses (log-sd ~0.3): 4x is within 7 robust sigmas, 40x is not
        (_noisy(30, sd=0.45) + [4.0] + _noisy(5, sd=0.45, seed=2), None, {}),
        (_noisy(30, sd=0.45) + [40.0] + _noisy(5, sd=0.45, seed=2), None, {30: "loss_spike"}),
        # a gradient norm 20x its median: grad_spike; 5x: nothing (factor 10)
        (_noisy(20), _noisy(15) + [20.0] + _noisy(4, seed=3), {15: "grad_spike"}),
        (_noisy(20), _noisy(15) + [5.0] + _noisy(4, seed=3), {}),
        # both on one step: the loss names the snapshot
        (_noisy(15) + [9.0] + _noisy(4), _noisy(15) + [50.0] + _noisy(4, seed=3), {15: "loss_spike"}),
        # non-finite, zero and negative values are skipped: no spike, no baseline entry
        (_noisy(15) + [math.inf, 0.0, -3.0] + _noisy(3), None, {15: "nonfinite_loss"}),
        # a loss falling to 1/10: spikes are upward only
        (_noisy(15) + [0.1] + _noisy(5), None, {}),
    ],
)
def test_spike_triggers_fire_on_the_first_step_of_a_jump_over_the_trailing_median(losses, grads, fires):
    got = _run(_spiky(W), losses, grads)
    assert {i: r for i, r in enumerate(got) if r} == fires


def test_a_spike_is_no_failure_and_its_evidence_names_the_baseline():
    t = _spiky(W)
    _run(t, _noisy(15))
    assert t.check(StepHealth(5.0, True, None, 1.0)) == "loss_spike"
    assert t.holding == []  # end_step returns None: a loop that stops on failures keeps training
    ev = t.spike
    assert ev["metric"] == "loss" and ev["value"] == 5.0 and 0.9 < ev["baseline"] < 1.1
    assert ev["ratio"] == pytest.approx(5.0 / ev["baseline"]) and ev["threshold"] >= 3.0 * ev["baseline"] * 0.999
    assert ev["window"] == 15 and ev["factor"] == 3.0
    assert t.check(StepHealth(1.0, True, None, 1.0)) is None and t.spike is None


def test_a_loss_that_keeps_climbing_faster_than_its_median_fires_once():
    # 20% a step for 80 steps: above the threshold from some step on and ever after, longer than the window
    got = [r for r in _run(_spiky(W), _noisy(15) + [1.2 ** i for i in range(1, 80)]) if r]
    assert got == ["loss_spike"]


def test_a_second_spike_waits_for_the_window_to_pass_then_fires_again():
    t = _spiky(W)
    seq = _noisy(15) + [6.0] + _noisy(5, seed=4) + [6.0] + _noisy(W, seed=5) + [8.0]
    got = {i: r for i, r in enumerate(_run(t, seq)) if r}
    assert got == {15: "loss_spike", 15 + 1 + 5 + 1 + W: "loss_spike"}  # the 2nd jump fell in the refractory window


def test_spike_snapshots_stop_at_their_own_cap_and_leave_max_snapshots_alone():
    t = _spiky(10, cap=2)
    seq = []
    for k in range(5):
        seq += _noisy(12, seed=k) + [9.0]
    fired = [r for r in _run(t, seq) if r]
    assert fired == ["loss_spike", "loss_spike"] and t.spikes_fired == 2 and t.fired == 0
    assert t.check(StepHealth(math.nan, True, None, None)) == "nonfinite_loss"  # the NaN snapshot is still there


def test_a_failure_snapshot_on_the_step_of_a_spike_takes_precedence_and_spends_no_spike():
    t = Triggers(min_scale=1.0, max_snapshots=10, spikes=SpikeWatch(loss_factor=3.0, grad_factor=None, window=W))
    for x in _noisy(15):
        t.check(StepHealth(x, True, 4.0, 1.0))
    assert t.check(StepHealth(9.0, True, 0.5, 1.0)) == "scale_collapse" and t.spikes_fired == 0 and t.spike is None


def test_the_warm_up_is_half_the_window_with_a_floor():
    assert [warmup_of(w) for w in (10, 20, 100, 1000)] == [10, 10, 50, 500]
    for w in (20, 100):
        t = _spiky(w)
        before = _run(t, _noisy(warmup_of(w) - 1) + [50.0])
        assert not any(before)
        t = _spiky(w)
        assert _run(t, _noisy(warmup_of(w)) + [50.0])[-1] == "loss_spike"


def test_a_spike_watch_with_both_factors_off_is_none():
    from recorders._meta import RecorderConfig
    from recorders.triggers import spike_watch

    assert spike_watch(RecorderConfig(loss_spike=None, grad_spike=None)) is None
    assert spike_watch(RecorderConfig()) is not None
