"""A hand-written exp that feeds a log, overflowing in FP16: the stable form is advised, untested.

Real recorded FP16 steps: ``log(1 + exp(x))`` (``tests/analyzer/autopsy/gnll_models``, the std head
of a Gaussian-NLL regressor) and ``log(sum(exp(s)))`` (``fix_models.HandLogSumExp``).
"""
from __future__ import annotations

import pytest
import torch

from analyzer.replay import advice_with_status, replay_snapshot, try_fixes

from . import fix_models as fm


@pytest.fixture(scope="module")
def logsumexp_step(tmp_path_factory):
    return fm.record(tmp_path_factory.mktemp("lse") / "run", factory="build_hand_logsumexp",
                     loss_fn="logsumexp_loss", batch=fm.logsumexp_batch(), amp_dtype=torch.float16)


def test_a_hand_written_logsumexp_overflowing_fp16_gets_the_logsumexp_advice(logsumexp_step):
    r = replay_snapshot(logsumexp_step)
    assert (r.verdict, r.culprit["op"], r.culprit["phase"]) == ("overflow", "aten.exp", "forward")
    advice = advice_with_status(r, try_fixes(logsumexp_step, r))
    [lse] = [a for a in advice if "torch.logsumexp(x, dim)" in a.text]
    assert lse.status == "untested" and lse.fix is None
    assert not [a for a in advice if "softplus" in a.text]


def test_a_hand_written_softplus_overflowing_fp16_gets_the_softplus_advice(tmp_path):
    from tests.analyzer.autopsy.gnll_models import FAIL_STEP
    from tests.analyzer.autopsy.test_autopsy_calibration import _train

    snap = _train(tmp_path / "run") / "snapshots"
    [path] = sorted(snap.glob(f"step{FAIL_STEP:08d}-*.pt"))
    r = replay_snapshot(path)
    assert (r.verdict, r.culprit["op"], r.culprit["module"]) == ("overflow", "aten.exp", "std")
    advice = advice_with_status(r, try_fixes(path, r))
    [sp] = [a for a in advice if "torch.nn.functional.softplus(x)" in a.text]
    assert sp.status == "untested" and sp.text.startswith("log(1 + exp(x)) is a hand-written softplus")
    assert not [a for a in advice if "logsumexp(x, dim)" in a.text]
