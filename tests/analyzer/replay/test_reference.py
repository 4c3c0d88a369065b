"""``_reference``: with the FP32 run non-finite too, a fix is judged on finiteness and plausibility, a loss
at most PLAUSIBLE_FACTOR times the last finite loss the run recorded (a real three-step FP32 run whose
third step takes log(0): the clamp gives log(tiny) = -87.3, a loss of 43.7)."""
from __future__ import annotations

import pytest
import torch

from analyzer.replay import Replay
from analyzer.replay.fixes._reference import PLAUSIBLE_FACTOR, last_finite_loss
from recorders import Recorder
from tests.analyzer.replay import replay_models as rm

REF = "tests.analyzer.replay.replay_models"
FAILING = {"x": torch.tensor([[2.0, 0, 0, 0], [1.0, 0, 0, 0]]), "y": torch.tensor([2, 0])}  # p(class 2) = 0


def _run(run_dir, y_before: int):
    """Steps 0 and 1 on x = (0.1, 0, 0, 0), logits (10, 0, -10), with label `y_before` (0: loss 4.5e-5;
    1: loss 10.00005), then the log(0) step."""
    model = rm.build_classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: step 2 fails as built
    with Recorder(run_dir, model, factory=f"{REF}:build_classifier", loss_fn=f"{REF}:log_prob_loss",
                  optimizer=opt) as rec:
        for step in range(3):
            batch = FAILING if step == 2 else {"x": torch.tensor([[0.1, 0, 0, 0]]), "y": torch.tensor([y_before])}
            rec.begin_step(step, batch)
            loss = rm.log_prob_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            opt.step()
            opt.zero_grad()
    return rec.snapshots[-1]


@pytest.mark.parametrize("y_before, status", [(1, "verified"), (0, "changes_result")])
def test_a_clamp_with_no_fp32_reference_is_judged_against_the_last_finite_recorded_loss(tmp_path, y_before, status):
    replay = Replay(_run(tmp_path / "run", y_before), device="cpu")
    r = replay.run()
    assert r.verdict == "numerical_bug" and not r.runs["float32"]["finite"]
    last = last_finite_loss(r)
    assert last == pytest.approx(10.00005 if y_before else 4.54e-5, rel=1e-2)  # step 1's recorded loss
    clamp = next(f for f in replay.try_fixes(r) if f.name == "guard_clamp")
    assert clamp.status == status and clamp.reference_loss == last
    assert clamp.loss == pytest.approx(-torch.log(torch.tensor(torch.finfo(torch.float32).tiny)).item() / 2, rel=1e-3)
    assert "no FP32 reference" in clamp.detail and f"{PLAUSIBLE_FACTOR:g}x" in clamp.detail
