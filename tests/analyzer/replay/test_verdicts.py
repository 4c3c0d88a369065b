"""The verdict and fix registries (``verdicts.VERDICTS``, ``fixes.FIXES``): an entry defined here, in the
test, flows through a real replay into the result, its advice and its fixes; advice is tied to fixes by
name, never by its wording."""
from __future__ import annotations

import dataclasses

import pytest

from analyzer.replay import FIXES, VERDICTS, AdviceLine, Diagnosis, Fix, FixSpec, Replay, Verdict, advice_with_status, register, register_fix
from analyzer.replay.verdicts import registry as verdicts

_NAME = "log_of_zero_test"
_LINE = "Clamp what goes into this log (a verdict defined in the test)."


def _log_of_zero() -> Verdict:
    """A throwaway verdict: a numerical bug whose culprit is a log (the whole entry, with its detection)."""
    return Verdict(
        _NAME, "The culprit is a log of an exact zero (defined in a test).",
        summary=lambda d: f"{d.culprit['op']} in `{d.culprit['module']}` took a log of zero ({d.culprit['precision']}).",
        advice=lambda d: [AdviceLine(_LINE, fixes=("guard_clamp",)), AdviceLine("Look at the data.")],
        fixes=("guard_clamp",), refines=("numerical_bug",),
        detect=lambda d: d.culprit is not None and d.culprit["op"] == "aten.log")


@pytest.fixture
def log_of_zero(monkeypatch):
    monkeypatch.setitem(VERDICTS, _NAME, _log_of_zero())  # removed again after the test


def test_a_verdict_defined_in_a_test_flows_into_the_result_its_json_and_its_advice(log_of_zero, log_zero_step):
    # logits (200, 0, -200): softmax's p(class 2) is exactly 0 in FP32, and the loss takes its log
    replay = Replay(log_zero_step)
    r = replay.run()
    assert r.verdict == _NAME and r.culprit["op"] == "aten.log"
    assert r.summary == f"aten.log in `{r.culprit['module']}` took a log of zero (float32)."
    assert r.advice == [_LINE, "Look at the data."]
    assert r.to_dict()["verdict"] == _NAME
    fixes = replay.try_fixes(r)
    assert [f.name for f in fixes] == ["guard_clamp"]  # the fixes the entry names, and no other
    assert fixes[0].status == "verified"
    advice = advice_with_status(r, fixes)
    # the verified clamp comes first; the entry's own line that rests on it is replaced, not repeated
    assert (advice[0].status, advice[0].fix) == ("verified", "guard_clamp")
    assert _LINE not in [a.text for a in advice]
    assert any(a.text == "Look at the data." and a.status == "untested" for a in advice)


def test_without_the_test_verdict_the_same_step_is_a_numerical_bug(log_zero_step):
    assert _NAME not in VERDICTS
    assert Replay(log_zero_step).run().verdict == "numerical_bug"


def test_a_fix_defined_in_a_test_is_tried_for_the_verdict_it_serves(monkeypatch, log_zero_step):
    def apply(_ctx, result) -> Fix:
        return Fix(name="noted_test", title="a fix defined in the test", status="not_tried",
                   detail=f"seen {result.culprit['op']}")

    monkeypatch.setitem(FIXES, "noted_test", FixSpec("noted_test", "a fix defined in the test", apply,
                                                     serves=("numerical_bug",), needs_model=False))
    replay = Replay(log_zero_step)
    r = replay.run()
    fixes = replay.try_fixes(r)
    assert fixes[-1] == Fix(name="noted_test", title="a fix defined in the test", status="not_tried",
                            detail="seen aten.log")
    assert "guard_clamp" in [f.name for f in fixes]  # the fixes already registered are still tried


def test_registering_a_taken_name_or_a_fix_for_an_unknown_verdict_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register(dataclasses.replace(VERDICTS["overflow"]))
    with pytest.raises(ValueError, match="unknown verdicts"):
        register_fix(FixSpec("nowhere_test", "t", lambda _c, _r: None, serves=("no_such_verdict",)))
    with pytest.raises(ValueError, match="refines and detect"):
        Verdict("half_test", "m", summary=str, advice=list, refines=("overflow",))


def test_every_fix_an_advice_line_or_a_verdict_names_is_registered():
    for v in VERDICTS.values():
        assert set(v.fixes) <= set(FIXES), v.name
    c = {"module": "m", "op": "aten.log", "phase": "forward", "precision": "float16", "node": None, "index": 0,
         "input_absmax": 1.0, "output_kind": "inf", "input_dtypes": ["float16"], "source": None}
    for name in ("overflow", "underflow", "unregistered_op", "loss_scale_overflow", "numerical_bug"):
        for line in verdicts.advice(Diagnosis(name, c, scale=65536.0)):
            assert set(line.fixes) <= set(FIXES), (name, line)


# -- advice is tied to fixes by name ---------------------------------------------------------------
@pytest.fixture(scope="module")
def bce(bce_step):
    replay = Replay(bce_step)
    r = replay.run()
    return r, replay.try_fixes(r)


@pytest.fixture(scope="module")
def log_zero(log_zero_step):
    replay = Replay(log_zero_step)
    r = replay.run()
    return r, replay.try_fixes(r)


@pytest.mark.parametrize("step", ["bce", "log_zero"])
def test_rewording_every_advice_line_keeps_which_fix_each_rests_on_and_its_status(step, request):
    # the BCE clamp changes the step's result (3% off FP32's loss, test_fixes.py), so its step ties lines
    # to fixes that fail or change the result; the FP32 log(0)'s clamp is verified (no FP32 reference)
    r, fixes = request.getfixturevalue(step)
    kinds = {"bce": {"changes_result", "fails"}, "log_zero": {"verified"}}[step]
    assert {f.status for f in fixes} >= kinds  # between the two steps, every kind of tie is exercised
    lines = tuple(AdviceLine(f"Reworded {i}: {a.text[::-1]}", a.fixes) for i, a in enumerate(r.advice_lines))
    reworded = dataclasses.replace(r, advice_lines=lines)
    before = [(a.status, a.fix) for a in advice_with_status(r, fixes)]
    after = [(a.status, a.fix) for a in advice_with_status(reworded, fixes)]
    assert after == before


def test_a_line_worded_like_a_fix_but_naming_none_is_kept_and_a_line_naming_a_failed_fix_is_dropped(bce):
    r, fixes = bce
    status = {f.name: f.status for f in fixes}
    assert status["bf16"] == "fails"  # bf16 rounds sigmoid to 1 as well
    alike = AdviceLine("Switch to BF16 (torch.autocast(..., dtype=torch.bfloat16)): it has FP32's range.")
    tied = AdviceLine("Any wording at all.", fixes=("bf16",))
    lines = (*r.advice_lines, alike, tied)
    r2 = dataclasses.replace(r, advice_lines=lines)
    texts = {a.text: a for a in advice_with_status(r2, fixes)}
    assert texts[alike.text].status == "untested" and texts[alike.text].fix is None
    assert tied.text not in texts
    # respect_runs reads names too: a failed bf16 replay drops the tied line, not the look-alike
    kept = verdicts.respect_runs([alike, tied], {"bfloat16": False})
    assert kept == [alike]
