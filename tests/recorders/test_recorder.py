"""The Recorder on real tiny training runs: meta.json, trace values, options, numerics, lifecycle."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch

from recorders import Recorder, schema
from tests.recorders import models
from tests.recorders.models import batches, build_dropout_mlp, build_frozen_mlp, build_mlp, mse_loss, sgd, train

REFS = {"factory": "tests.recorders.models:build_mlp", "loss_fn": "tests.recorders.models:mse_loss"}


def read(run, kind="steps"):
    return pl.read_parquet(run / schema.TRACE_DIR / f"{kind}-*.parquet").sort(
        ["step", "layer"] if kind == "layers" else "step")


def fp16_run(tmp_path, n=12, unscale=False, on_step=None, **kw):
    """A real FP16 + GradScaler run on CPU. The initial scale 65536 overflows FP16 in backward,
    so GradScaler skips and backs off at least once (asserted by the tests that rely on it)."""
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu")
    opt = sgd(model)
    run = tmp_path / "run"
    with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt, **kw) as rec:
        train(model, batches(n), rec=rec, opt=opt, amp_dtype=torch.float16, scaler=scaler,
              unscale=unscale, on_step=on_step)
    return run, rec


def test_meta_json_holds_every_key_and_the_parameters_in_model_order(tmp_path):
    model = build_dropout_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    Recorder(tmp_path, model, factory=models.build_dropout_mlp, factory_kwargs={"width": 8},
             loss_fn=mse_loss, scaler=scaler, amp_dtype=torch.bfloat16, flush_every=9).close()
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert tuple(meta) == schema.META_KEYS
    assert meta["format"] == schema.META_FORMAT and meta["format_version"] == schema.FORMAT_VERSION
    assert meta["torch_version"] == torch.__version__
    assert (meta["rank"], meta["world_size"], meta["device_type"]) == (0, 1, "cpu")
    assert meta["amp_dtype"] == "bfloat16"
    # the scaler's configuration, without its live state (scale, growth tracker)
    assert meta["scaler"] == {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7,
                              "init_scale": 1024.0}
    assert [p["name"] for p in meta["params"]] == [n for n, _ in model.named_parameters()]
    assert meta["params"][0] == {"name": "0.weight", "shape": [8, 8], "numel": 64, "dtype": "float32",
                                 "depth": 0}
    assert [b["name"] for b in meta["buffers"]] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    # functions given as objects are stored by the name that resolves back to them
    assert meta["factory"] == "tests.recorders.models:build_dropout_mlp"
    assert meta["loss_fn"] == "tests.recorders.models:mse_loss"
    assert (meta["factory_kwargs"], meta["layer_every"], meta["flush_every"]) == ({"width": 8}, 1, 9)


def test_trace_holds_one_row_per_step_with_the_schema_dtypes(tmp_path):
    run, _ = fp16_run(tmp_path, n=12, flush_every=5)
    steps, layers = read(run), read(run, "layers")
    assert dict(steps.schema) == schema.STEP_COLUMNS
    assert dict(layers.schema) == schema.LAYER_COLUMNS
    assert steps["step"].to_list() == list(range(12))
    # 12 steps, flush_every 5: parts of 5, 5 and 2 (the last written by close)
    assert len(list((run / "trace").glob(schema.STEPS_GLOB))) == 3
    assert layers.height == 12 * 10  # build_mlp(depth=2) has 10 parameters
    assert steps["loss_dtype"].unique().to_list() == ["float32"]  # mse_loss casts to float
    assert steps["lr"].unique().to_list() == [0.05]


def test_recorded_gradient_norms_are_the_unscaled_norms_of_each_parameter(tmp_path):
    expected = {}

    def capture(step, opt):
        scale = opt_scaler[0].get_scale()
        expected[step] = [(p.grad.double().norm() / scale).item() for p in opt.param_groups[0]["params"]]

    opt_scaler = []
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu")
    opt_scaler.append(scaler)
    opt = sgd(model)
    with Recorder(tmp_path, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        train(model, batches(8), rec=rec, opt=opt, amp_dtype=torch.float16, scaler=scaler, on_step=capture)
    layers, steps = read(tmp_path, "layers"), read(tmp_path)
    finite = {s: n for s, n in expected.items() if all(math.isfinite(v) for v in n)}
    assert len(finite) >= 4, "most steps of the scenario do not overflow"
    for step, norms in finite.items():
        got = layers.filter(pl.col("step") == step)["grad_norm"].to_list()
        assert got == pytest.approx(norms, rel=1e-5)
        total = math.sqrt(sum(n * n for n in norms))
        assert steps["grad_norm"][step] == pytest.approx(total, rel=1e-5)


def test_gradients_already_unscaled_by_the_loop_are_not_divided_again(tmp_path):
    seen = {}

    def capture(step, opt):  # after scaler.unscale_(opt): p.grad is the true gradient
        seen[step] = [p.grad.double().norm().item() for p in opt.param_groups[0]["params"]]

    run, _ = fp16_run(tmp_path, n=6, unscale=True, on_step=capture)
    layers = read(run, "layers")
    finite = {s: n for s, n in seen.items() if all(math.isfinite(v) for v in n)}
    assert len(finite) >= 3, "most steps of the scenario do not overflow"
    for step, norms in finite.items():
        assert layers.filter(pl.col("step") == step)["grad_norm"].to_list() == pytest.approx(norms, rel=1e-5)


def test_skipped_is_true_exactly_on_the_steps_where_grad_scaler_backed_off(tmp_path):
    run, _ = fp16_run(tmp_path, n=16)
    steps = read(run)
    scales = steps["scale"].to_list()
    # GradScaler halves the scale after a skipped step and never shrinks it otherwise
    backed_off = [scales[i + 1] < scales[i] for i in range(len(scales) - 1)]
    assert any(backed_off), "the scenario must contain at least one overflow"
    assert steps["skipped"].to_list()[:-1] == backed_off
    # a skipped step has non-finite scaled gradients, counted exactly
    skipped = steps.filter(pl.col("skipped"))
    assert (skipped["nonfinite_grads"] > 0).all()
    assert steps.filter(~pl.col("skipped"))["nonfinite_grads"].to_list() == [0] * (steps.height - skipped.height)


def test_per_layer_counts_match_the_gradients_on_an_overflowing_step(tmp_path):
    seen = {}

    def capture(step, opt):
        seen[step] = [(int((~torch.isfinite(p.grad)).sum()), (p.grad == 0).float().mean().item(),
                       p.detach().norm().item()) for p in opt.param_groups[0]["params"]]

    run, _ = fp16_run(tmp_path, n=6, on_step=capture)
    layers = read(run, "layers")
    overflowed = [s for s, v in seen.items() if any(c for c, _, _ in v)]
    assert overflowed, "the scenario must contain at least one overflow"
    for step, values in seen.items():
        rows = layers.filter(pl.col("step") == step)
        assert rows["grad_nonfinite"].to_list() == [c for c, _, _ in values]
        assert rows["grad_zero_frac"].to_list() == pytest.approx([z for _, z, _ in values])
        assert rows["param_norm"].to_list() == pytest.approx([n for _, _, n in values], rel=1e-6)


def test_layer_every_thins_layer_rows_but_failing_steps_always_get_them(tmp_path):
    data = batches(10)
    data[8]["x"][0, 0] = float("nan")  # a NaN input at step 8 makes the loss NaN ...
    model = build_mlp()
    with Recorder(tmp_path, model, **REFS, layer_every=4) as rec:
        train(model, data, rec=rec)
    layers = read(tmp_path, "layers")
    # ... and (no scaler) SGD applies the NaN gradients, so step 9 fails too. Due steps: 0, 4, 8.
    assert read(tmp_path)["loss"].is_nan().to_list() == [False] * 8 + [True, True]
    assert sorted(layers["step"].unique().to_list()) == [0, 4, 8, 9]


def test_parameters_without_gradients_get_null_gradient_columns(tmp_path):
    model = build_frozen_mlp()
    with Recorder(tmp_path, model, **REFS) as rec:
        train(model, batches(3), rec=rec)
    rows = read(tmp_path, "layers").filter(pl.col("step") == 1)
    # layer 0 (weight, bias) is frozen; the rest train
    assert rows["grad_norm"].is_null().to_list() == [True, True, False, False, False, False]
    assert rows["grad_nonfinite"].is_null().to_list() == [True, True, False, False, False, False]
    assert rows["param_norm"].is_null().sum() == 0


def test_loss_may_be_a_float_or_none_and_lr_follows_the_scheduler(tmp_path):
    model = build_mlp()
    opt = sgd(model, lr=0.1)
    with Recorder(tmp_path, model, **REFS, optimizer=opt) as rec:
        for step, batch in enumerate(batches(3)):
            rec.begin_step(step, batch)
            loss = mse_loss(model, batch)
            loss.backward()
            rec.end_step([loss.item(), None, float("inf")][step])
            assert rec.last["step"] == step and rec.last["lr"] == opt.param_groups[0]["lr"]
            opt.step()
            opt.zero_grad()
            opt.param_groups[0]["lr"] *= 0.5
    steps = read(tmp_path)
    assert steps["loss"][1] is None and steps["loss"][2] == float("inf")
    assert steps["loss_dtype"].to_list() == [None, None, None]  # a float carries no dtype
    assert steps["lr"].to_list() == [0.1, 0.05, 0.025]
    assert steps["skipped"].to_list() == [False] * 3  # no scaler: every optimizer step runs


def test_training_with_the_recorder_is_bitwise_identical_to_training_without(tmp_path):
    def run(record, amp):
        torch.manual_seed(123)
        model = build_dropout_mlp()
        scaler = torch.amp.GradScaler("cpu") if amp else None
        opt = sgd(model)
        rec = Recorder(tmp_path / f"r{amp}", model, **REFS, scaler=scaler, optimizer=opt,
                       amp_dtype=torch.float16 if amp else None, flush_every=3, enabled=record)
        with rec:
            losses = train(model, batches(10), rec=rec, opt=opt, scaler=scaler,
                           amp_dtype=torch.float16 if amp else None)
        return model.state_dict(), losses, torch.get_rng_state()

    for amp in (True, False):
        (sa, la, ra), (sb, lb, rb) = run(False, amp), run(True, amp)
        assert la == lb
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert torch.equal(ra, rb)  # the recorder drew no random numbers
        assert (tmp_path / f"r{amp}" / "trace").is_dir()


def test_a_disabled_recorder_does_nothing_and_creates_nothing(tmp_path):
    model = build_mlp()
    rec = Recorder(tmp_path / "never", model, enabled=False)
    with rec:
        train(model, batches(2), rec=rec)
        assert rec.snapshot() is None
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"factory": lambda: None}, ValueError, "top-level"),
    ({"factory": "no_colon"}, ValueError, "pkg.module:function"),
    ({"factory_kwargs": {"dtype": torch.float16}}, ValueError, "JSON"),
    ({"layer_every": 0}, ValueError, "layer_every"),
    ({"flush_every": 2.5}, ValueError, "flush_every"),
    ({"max_snapshots": -1}, ValueError, "max_snapshots"),
    ({"min_scale": float("nan")}, ValueError, "min_scale"),
    ({"amp_dtype": torch.float64}, ValueError, "amp_dtype"),
    ({"scaler": object()}, TypeError, "GradScaler"),
    ({"fp8_every": 0}, ValueError, "fp8_every"),
    ({"fp8_every": True}, ValueError, "fp8_every"),
])
def test_bad_arguments_raise_at_construction_naming_the_argument(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        Recorder(tmp_path, build_mlp(), **kwargs)


def test_steps_out_of_order_raise_a_clear_error(tmp_path):
    model = build_mlp()
    rec = Recorder(tmp_path, model)
    with pytest.raises(RuntimeError, match="without begin_step"):
        rec.end_step(1.0)
    rec.begin_step(0, None)
    rec.end_step(1.0)
    with pytest.raises(RuntimeError, match="twice"):
        rec.end_step(1.0)
    rec.close()
    with pytest.raises(RuntimeError, match="closed"):
        rec.begin_step(1, None)


def test_an_exception_inside_with_closes_the_recorder_and_keeps_the_steps_so_far(tmp_path):
    model = build_mlp()

    def boom(step, opt):
        if step == 3:
            raise KeyError("the loop's own bug")

    with pytest.raises(KeyError):
        with Recorder(tmp_path, model, **REFS, flush_every=100) as rec:
            train(model, batches(6), rec=rec, on_step=boom)
    assert rec.closed
    assert read(tmp_path)["step"].to_list() == [0, 1, 2, 3]
    # the recorder registers nothing on the model: no hooks can be left behind
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())


def test_a_second_recorder_in_the_same_run_dir_continues_the_part_numbers(tmp_path):
    for n in (3, 2):
        model = build_mlp()
        with Recorder(tmp_path, model, **REFS, flush_every=2) as rec:
            train(model, batches(n), rec=rec)
    names = sorted(p.name for p in (tmp_path / "trace").glob(schema.STEPS_GLOB))
    # first run: parts 0 (steps 0-1) and 1 (step 2); second run: part 2 (steps 0-1)
    assert names == [schema.part_name("steps", 0, i) for i in range(3)]
    assert read(tmp_path)["step"].to_list() == [0, 0, 1, 1, 2]


def test_finite_gradients_whose_float32_norm_overflows_are_measured_exactly_and_are_no_failure(tmp_path):
    expected = []

    def capture(step, opt):
        grads = [p.grad for p in opt.param_groups[0]["params"]]
        assert all(torch.isfinite(g).all() for g in grads)
        assert not torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()  # float32 overflows
        expected.append([g.double().norm().item() for g in grads])

    model = build_mlp()
    with Recorder(tmp_path, model, **REFS) as rec:
        train(model, batches(1), rec=rec, loss_fn=models.huge_loss, on_step=capture)
    steps, layers = read(tmp_path), read(tmp_path, "layers")
    assert steps["nonfinite_grads"].to_list() == [0]
    assert steps["grad_norm"][0] == pytest.approx(math.hypot(*expected[0]), rel=1e-9)
    assert layers["grad_nonfinite"].to_list() == [0] * 10
    # each per-layer norm (~1e21) fits float32 again once taken in float64
    assert layers["grad_norm"].to_list() == pytest.approx(expected[0], rel=1e-6)
    assert not (tmp_path / "snapshots").exists()


def test_a_loss_with_more_than_one_element_is_refused(tmp_path):
    model = build_mlp()
    rec = Recorder(tmp_path, model)
    rec.begin_step(0, None)
    with pytest.raises(ValueError, match="scalar loss"):
        rec.end_step(torch.ones(3))


@pytest.mark.parametrize("given, stored", [
    ("bf16", "bfloat16"), (torch.float16, "float16"), (torch.float32, None), (None, None),
])
def test_amp_dtype_may_be_a_dtype_or_a_name_and_fp32_means_no_amp(tmp_path, given, stored):
    Recorder(tmp_path, build_mlp(), amp_dtype=given).close()
    assert json.loads((tmp_path / "meta.json").read_text())["amp_dtype"] == stored


def test_a_tensor_learning_rate_is_recorded_like_a_float(tmp_path):
    model = build_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    with Recorder(tmp_path, model, **REFS, optimizer=opt) as rec:
        train(model, batches(2), rec=rec, opt=opt)
    assert read(tmp_path)["lr"].to_list() == pytest.approx([0.01, 0.01])


def test_a_late_end_step_after_scaler_step_still_records_unscaled_gradient_norms(tmp_path):
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu", init_scale=256.0)
    opt = sgd(model)
    expected = []
    with Recorder(tmp_path, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt) as rec:
        for step, batch in enumerate(batches(3)):
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)  # unscales the gradients in place (SGD leaves them as they are)
            expected.append([p.grad.norm().item() for p in model.parameters()])
            rec.end_step(loss)
            scaler.update()
            opt.zero_grad()
    layers = read(tmp_path, "layers")
    for step, norms in enumerate(expected):
        assert layers.filter(pl.col("step") == step)["grad_norm"].to_list() == pytest.approx(norms, rel=1e-5)


def _nan_loss_run(run, layer_every):
    """FP16 + GradScaler; step 4's loss is NaN, its (scaled) gradients finite."""
    model, scaler = build_mlp(), torch.amp.GradScaler("cpu", init_scale=256.0)
    opt = sgd(model)
    with Recorder(run, model, **REFS, scaler=scaler, amp_dtype=torch.float16, optimizer=opt,
                  layer_every=layer_every) as rec:
        for step, batch in enumerate(batches(6)):
            rec.begin_step(step, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse_loss(model, batch)
            scaler.scale(loss).backward()
            assert rec.end_step(loss * math.nan if step == 4 else loss) == ("nonfinite_loss" if step == 4 else None)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return run


def test_a_failing_step_between_layer_rows_gets_the_same_layer_row_as_with_layer_every_1(tmp_path):
    # with layer_every=3, step 4 fails off the cadence: on the CPU its values are read one by one,
    # then its layer row is built from the same norms, divided by the scale
    every, thinned = _nan_loss_run(tmp_path / "every", 1), _nan_loss_run(tmp_path / "thinned", 3)
    assert read(every).drop("wall_time").equals(read(thinned).drop("wall_time"))
    cols = ["step", "layer", "grad_norm", "grad_nonfinite", "grad_zero_frac", "param_norm"]
    thinned_rows = read(thinned, "layers").select(cols)
    assert sorted(thinned_rows["step"].unique()) == [0, 3, 4]
    assert thinned_rows.filter(pl.col("step") == 4)["grad_norm"].is_finite().all()
    every_rows = read(every, "layers").select(cols).filter(pl.col("step").is_in([0, 3, 4]))
    assert every_rows.equals(thinned_rows)
