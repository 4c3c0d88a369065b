"""The recorder sees the update: optimizer in meta and snapshots, update snapshots, update columns."""
from __future__ import annotations

import json
import math
import warnings

import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from analyzer.load import load_run, load_snapshot
from recorders import Recorder, schema
from recorders.recorder import RecorderWarning
from tests import update_runs
from tests.recorders.models import batches, build_mlp, mse_loss, train


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise identity, NaN payloads included (torch.equal says NaN != NaN)."""
    return t.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture
def fp16_run(fp16_adam_eps_update_run):
    """The session's pure-FP16 Adam run with check_update=True (tests/conftest.py); read only."""
    return fp16_adam_eps_update_run


@pytest.fixture
def stall_runs(bf16_stall_run, fp32_stall_run):
    return bf16_stall_run, fp32_stall_run


def _by_reason(info) -> dict:
    return {load_snapshot(p).reason: load_snapshot(p) for p in info["snapshots"]}


# ---------------------------------------------------------------------------- update snapshots
def test_an_fp16_adam_update_of_zero_gradients_is_snapshotted_at_the_step_that_made_the_weights_nan(fp16_run):
    snaps = _by_reason(fp16_run)
    # one update snapshot (the edge, not every NaN step after it), then the next step's NaN loss
    assert sorted((s.step, r) for r, s in snaps.items()) == [(update_runs.UNFREEZE, "update"),
                                                             (update_runs.UNFREEZE + 1, "nonfinite_loss")]
    up = snaps["update"]
    assert math.isfinite(fp16_run["losses"][up.step]) and math.isnan(fp16_run["losses"][up.step + 1])
    assert up.update["nonfinite_params"] == ["emb.weight"]
    grad, post = up.update["grads"]["emb.weight"], up.update["post_params"]["emb.weight"]
    # rows the step's batch did not use had gradient exactly 0, and exactly those became NaN: 0/(0 + 0)
    zero_rows = (grad == 0).all(dim=1)
    assert zero_rows.sum().item() == 14 and torch.equal(torch.isnan(post).all(dim=1), zero_rows)
    # model_state holds the weights after the update, bit for bit those in post_params
    for name, t in up.update["post_params"].items():
        assert torch.equal(_bits(up.model_state[name]), _bits(t))


def test_a_snapshot_carries_the_optimizer_class_state_and_parameter_names_loadable_weights_only(fp16_run):
    snaps = _by_reason(fp16_run)
    for snap in snaps.values():
        opt = snap.optimizer
        assert opt["class"] == "torch.optim.adam.Adam"
        assert opt["param_names"] == ["emb.weight", "head.weight", "head.bias"]
        assert set(opt["param_names"]) <= set(snap.model_state)
        group = opt["state_dict"]["param_groups"][0]
        assert group["eps"] == 1e-8 and group["lr"] == 1e-3 and group["params"] == [0, 1, 2]
        raw = torch.load(snap.path, weights_only=True)
        assert raw["optimizer"]["class"] == opt["class"]
    up = snaps["update"]
    state = up.optimizer["state_dict"]["state"][0]  # emb.weight, after its first step
    assert state["exp_avg_sq"].dtype == torch.float16 and float(state["step"]) == 1.0
    # post-step state: exp_avg_sq is exactly 0 where the update was 0/0 (eps 1e-8 is 0 in float16)
    nan = torch.isnan(up.update["post_params"]["emb.weight"])
    assert (state["exp_avg_sq"][nan] == 0).all() and (state["exp_avg"][nan] == 0).all()
    assert snaps["nonfinite_loss"].update is None


def test_without_check_update_there_is_no_update_snapshot_and_the_trace_shows_nan_weights_after_finite_grads(
        fp16_adam_eps_run):
    info = fp16_adam_eps_run
    assert [load_snapshot(p).reason for p in info["snapshots"]] == ["nonfinite_loss"]
    run = load_run(info["run_dir"])
    emb = run.params.index("emb.weight")
    rows = run.layers.filter(pl.col("layer") == emb).sort("step").collect()
    by_step = {r["step"]: r for r in rows.iter_rows(named=True)}
    n = update_runs.UNFREEZE
    assert math.isfinite(by_step[n]["grad_norm"]) and by_step[n]["grad_nonfinite"] == 0
    assert math.isfinite(by_step[n]["param_norm"]) and math.isnan(by_step[n + 1]["param_norm"])


def test_clipping_an_infinite_gradient_is_snapshotted_with_the_clipped_gradients_the_step_used(clip_inf_update_run):
    info = clip_inf_update_run
    snaps = _by_reason(info)
    assert {r: s.step for r, s in snaps.items()} == {"nonfinite_grads": 4, "update": 4, "nonfinite_loss": 5}
    up = snaps["update"]
    g = up.update["grads"]["0.weight"]
    # clip_grad_norm_ scaled every gradient by 1/(inf + 1e-6) = 0: the inf element became inf * 0 = NaN
    assert math.isnan(g[0, 0].item()) and (g.flatten()[1:] == 0).all() and (up.update["grads"]["0.bias"] == 0).all()
    assert up.update["nonfinite_params"] == ["0.weight"]
    assert torch.isnan(up.model_state["0.weight"]).sum().item() == 1
    assert up.optimizer["class"] == "torch.optim.sgd.SGD"
    assert "momentum_buffer" in up.optimizer["state_dict"]["state"][0]


def test_check_update_without_an_optimizer_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="optimizer"):
        Recorder(tmp_path, build_mlp(), check_update=True)


# ---------------------------------------------------------------------------- meta
def test_meta_records_the_optimizer_class_hyperparameters_and_layer_indices_of_each_group(tmp_path):
    model = build_mlp()
    params = list(model.parameters())
    extra = nn.Parameter(torch.zeros(3))  # held by the optimizer, not a parameter of the model
    opt = torch.optim.AdamW([{"params": params[:2], "lr": 1e-2}, {"params": params[2:] + [extra]}],
                            lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1)
    with Recorder(tmp_path, model, optimizer=opt):
        pass
    meta = json.loads((tmp_path / schema.META_FILE).read_text())
    assert meta["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    g0, g1 = meta["optimizer"]["param_groups"]
    assert (g0["lr"], g1["lr"], g1["betas"], g1["weight_decay"], g1["eps"]) == (1e-2, 1e-3, [0.8, 0.9], 0.1, 1e-8)
    assert g0["params"] == [0, 1] and g1["params"] == list(range(2, len(params))) + [None]
    assert [p["dtype"] for p in meta["params"]] == ["float32"] * len(params)


def test_meta_optimizer_is_null_without_an_optimizer(tmp_path):
    with Recorder(tmp_path, build_mlp()):
        pass
    assert json.loads((tmp_path / schema.META_FILE).read_text())["optimizer"] is None


# ---------------------------------------------------------------------------- update columns
def _layer(run_dir, name) -> pl.DataFrame:
    run = load_run(run_dir)
    return run.layers.filter(pl.col("layer") == run.params.index(name)).sort("step").collect()


def test_a_bf16_layer_whose_updates_are_below_half_an_ulp_is_recorded_unchanged_with_normal_gradients(stall_runs):
    bf16, fp32 = stall_runs
    rows = _layer(bf16["run_dir"], "2.weight")
    assert rows["update_rms"][0] is None and rows["unchanged_frac"][0] is None  # nothing to compare yet
    assert rows["unchanged_frac"][1:].to_list() == [1.0] * (bf16["steps"] - 1)
    assert rows["update_rms"][1:].to_list() == [0.0] * (bf16["steps"] - 1)
    assert (rows["grad_norm"] > 1e-3).all()  # normal gradients (0.0125 to 0.19 here): not a zero-gradient stall
    # the same model in FP32 changes that layer at every step
    rows32 = _layer(fp32["run_dir"], "2.weight")
    assert (rows32["unchanged_frac"][1:] < 0.5).all() and (rows32["update_rms"][1:] > 1e-5).all()
    for name in bf16["changing"]:  # the BF16 run's other layers do change
        assert (_layer(bf16["run_dir"], name)["unchanged_frac"][1:] < 1.0).all()


def _record_weights(tmp_path, model, steps, layer_every=1):
    """Train with the recorder, keeping a copy of every weight before each step's update."""
    seen: list[dict] = []
    with Recorder(tmp_path, model, layer_every=layer_every) as rec:
        train(model, batches(steps, width=model[0].in_features), rec=rec,
              on_step=lambda step, opt: seen.append({n: p.detach().clone() for n, p in model.named_parameters()}))
    return seen


def test_update_rms_and_unchanged_frac_match_the_weights_on_the_fixed_sample(tmp_path):
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 1))  # 5000 > SAMPLE elements
    seen = _record_weights(tmp_path, model, steps=5, layer_every=2)
    rows = _layer(tmp_path, "0.weight")
    assert rows["step"].to_list() == [0, 2, 4]
    # the sample: 64 runs of 64 contiguous elements, starting every 5000 // 64 = 78 elements
    index = torch.cat([torch.arange(i * 78, i * 78 + 64) for i in range(64)])
    for i, step in enumerate(rows["step"].to_list()[1:], 1):
        now = seen[step]["0.weight"].reshape(-1)[index]
        then = seen[step - 2]["0.weight"].reshape(-1)[index]  # the previous recorded row (layer_every=2)
        want = (now.double() - then.double()).pow(2).mean().sqrt().item()
        assert rows["update_rms"][i] == pytest.approx(want, rel=1e-5)
        assert rows["unchanged_frac"][i] == pytest.approx((now == then).double().mean().item(), abs=1e-7)
    small = _layer(tmp_path, "2.weight")  # 50 elements: all of them
    now, then = seen[4]["2.weight"], seen[2]["2.weight"]
    assert small["update_rms"][2] == pytest.approx((now.double() - then.double()).pow(2).mean().sqrt().item(), rel=1e-5)


def test_recording_the_update_columns_and_check_update_leave_training_bitwise_unchanged(tmp_path):
    results = []
    for rec_on in (False, True):
        torch.manual_seed(0)
        model = update_runs.build_stall_mlp("bfloat16")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        rec = Recorder(tmp_path / str(rec_on), model, optimizer=opt, check_update=True) if rec_on else None
        losses = train(model, update_runs._mlp_batches(6, torch.bfloat16), rec=rec, opt=opt,
                       loss_fn=update_runs.regression_loss)
        if rec is not None:
            rec.close()
            assert not rec.stopped
        results.append((losses, {n: _bits(p) for n, p in model.named_parameters()}, torch.get_rng_state()))
    (l0, w0, r0), (l1, w1, r1) = results
    assert l0 == l1 and all(torch.equal(w0[n], w1[n]) for n in w0) and torch.equal(r0, r1)


# ---------------------------------------------------------------------------- never crash
def _drop_head_bias_then_unfreeze(run_dir=None):
    """Pure FP16 + Adam; after step 0 head.bias leaves the optimizer's param group (its Adam state stays,
    so ``optimizer.state_dict()`` raises KeyError); at step 1 the embedding trains and its update is NaN."""
    model = update_runs.build_embedding_regressor()
    model.emb.weight.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = Recorder(run_dir, model, optimizer=opt, check_update=True) if run_dir is not None else None

    def on_step(step, model):
        if step == 0:
            model.emb.weight.requires_grad_(True)

    def drop(step):
        if step == 0:
            group = opt.param_groups[0]
            group["params"] = [p for p in group["params"] if p is not model.head.bias]

    losses = []
    for step in range(4):
        batch = update_runs._token_batch(step)
        if rec is not None:
            rec.begin_step(step, batch)
        loss = update_runs.regression_loss(model, batch)
        loss.backward()
        if rec is not None:
            rec.end_step(loss)
        opt.step()
        drop(step)
        on_step(step, model)
        opt.zero_grad()
        losses.append(loss.item())
    if rec is not None:
        rec.close()
    return losses, {n: _bits(p) for n, p in model.named_parameters()}, rec


def test_an_error_inside_the_optimizer_step_hook_warns_once_stops_recording_and_training_is_unchanged(tmp_path):
    plain_losses, plain_state, _ = _drop_head_bias_then_unfreeze()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, state, rec = _drop_head_bias_then_unfreeze(tmp_path)
    warned = [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]
    assert len(warned) == 1 and "optimizer step post hook" in warned[0] and "KeyError" in warned[0]
    assert rec.stopped and rec.snapshots == []
    assert [str(x) for x in losses] == [str(x) for x in plain_losses]  # NaN-aware equality
    assert all(torch.equal(state[n], plain_state[n]) for n in state)
    # the steps before the error reached the disk
    assert load_run(tmp_path).steps.collect()["step"].to_list() == [0, 1]


def test_the_optimizer_step_hook_is_registered_while_recording_and_removed_on_close(tmp_path):
    model = update_runs.build_embedding_regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(tmp_path / "on", model, optimizer=opt, check_update=True):
        assert len(opt._optimizer_step_post_hooks) == 1
    assert len(opt._optimizer_step_post_hooks) == 0
    with Recorder(tmp_path / "off", model, optimizer=opt):  # check_update=False registers nothing
        assert len(opt._optimizer_step_post_hooks) == 0


# ---------------------------------------------------------------------------- older runs
def _as_version_2(src, dst, drop_columns_in: set[int] | None = None) -> None:
    """Copy a run as an older recorder wrote it: meta without 'optimizer', parts without the new columns."""
    dst.mkdir(parents=True)
    meta = json.loads((src / schema.META_FILE).read_text())
    meta.pop("optimizer")
    meta["format_version"] = 2
    (dst / schema.META_FILE).write_text(json.dumps(meta))
    (dst / schema.TRACE_DIR).mkdir()
    for i, part in enumerate(sorted((src / schema.TRACE_DIR).iterdir())):
        frame = pl.read_parquet(part)
        if drop_columns_in is None or i in drop_columns_in:
            frame = frame.drop([c for c in schema.COLUMNS_ADDED if c in frame.columns])
        frame.write_parquet(dst / schema.TRACE_DIR / part.name)


def test_a_version_2_run_and_snapshot_load_with_null_columns_and_none_keys(tmp_path, fp16_run):
    src = fp16_run["run_dir"]
    _as_version_2(src, tmp_path / "v2")
    layers = load_run(tmp_path / "v2").layers.collect()
    assert layers["update_rms"].null_count() == layers["unchanged_frac"].null_count() == layers.height > 0
    snap = torch.load(fp16_run["snapshots"][1], weights_only=True)
    for key in [k for k, v in schema.KEYS_ADDED.items() if v == 3]:
        snap.pop(key, None)
    snap["format_version"] = 2
    torch.save(snap, tmp_path / "v2.pt")
    old = load_snapshot(tmp_path / "v2.pt")
    assert old.optimizer is None and old.update is None and old.step == fp16_run["nan_loss_step"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old_parts=st.sets(st.integers(0, 5)), values=st.lists(
    st.sampled_from([0.0, 1.0, float("nan"), float("inf"), -float("inf"), None, 1e-3]), min_size=1, max_size=8))
def test_runs_mixing_parts_with_and_without_the_update_columns_load_with_nulls_for_the_old_parts(
        tmp_path_factory, old_parts, values):
    src = tmp_path_factory.mktemp("src")
    model = build_mlp()
    with Recorder(src, model, flush_every=2) as rec:  # three steps parts and three layers parts
        train(model, batches(6), rec=rec)
    # arbitrary values (NaN, Inf, null) in the new columns of every part first
    for part in (src / schema.TRACE_DIR).glob("layers-*"):
        frame = pl.read_parquet(part)
        fill = [values[i % len(values)] for i in range(frame.height)]
        frame.with_columns(update_rms=pl.Series(fill, dtype=pl.Float32)).write_parquet(part)
    dst = tmp_path_factory.mktemp("mixed") / "run"
    _as_version_2(src, dst, drop_columns_in=old_parts)
    layers = load_run(dst).layers.collect()
    names = sorted(p.name for p in (src / schema.TRACE_DIR).iterdir())
    old_layer_parts = {n for i, n in enumerate(names) if i in old_parts and n.startswith("layers")}
    per_step = layers.group_by("step").agg(pl.col("unchanged_frac").null_count().alias("nulls"), pl.len())
    assert layers.height == 6 * len(load_run(dst).params) and dict(layers.schema) == schema.LAYER_COLUMNS
    old_steps = {s for n in old_layer_parts for s in pl.read_parquet(dst / schema.TRACE_DIR / n)["step"].to_list()}
    for row in per_step.iter_rows(named=True):
        if row["step"] in old_steps or row["step"] == 0:
            assert row["nulls"] == row["len"]
        else:
            assert row["nulls"] == 0


class _Wrapper:
    """An optimizer wrapper as some frameworks have one: param_groups, step, state_dict, no step hooks."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt, self.param_groups = opt, opt.param_groups

    def state_dict(self):
        return self.opt.state_dict()

    def step(self):
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none)


def test_check_update_with_an_optimizer_without_step_hooks_warns_and_records_the_rest(tmp_path):
    model = build_mlp()
    opt = _Wrapper(torch.optim.SGD(model.parameters(), lr=0.05))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, model, optimizer=opt, check_update=True) as rec:
            train(model, batches(3), rec=rec, opt=opt)
    warned = [str(w.message) for w in caught if issubclass(w.category, RecorderWarning)]
    assert len(warned) == 1 and "register_step_post_hook" in warned[0]
    assert not rec.stopped and load_run(tmp_path).steps.collect().height == 3
    assert json.loads((tmp_path / schema.META_FILE).read_text())["optimizer"]["class"].endswith("_Wrapper")


# ---------------------------------------------------------------------------- hostile files
_TENSOR = torch.zeros(3)
_HOSTILE = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20)
    | st.just(_TENSOR) | st.just(torch.zeros(1).expand(10**6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8) | st.integers(0, 3), inner,
                                                                max_size=3),
    max_leaves=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["optimizer", "update"]), value=_HOSTILE, field=st.sampled_from(
    [None, "class", "state_dict", "param_names", "grads", "post_params", "nonfinite_params"]))
def test_hostile_optimizer_and_update_keys_load_or_fail_with_one_bad_input_error(tmp_path_factory, fp16_run, key,
                                                                                 value, field):
    from analyzer.errors import BadInputError

    snap = torch.load(fp16_run["snapshots"][0], weights_only=True)  # the update snapshot: both keys set
    if field is None or not isinstance(snap[key], dict) or field not in snap[key]:
        snap[key] = value
    else:
        snap[key][field] = value
    path = tmp_path_factory.mktemp("hostile") / "s.pt"
    torch.save(snap, path)
    try:
        loaded = load_snapshot(path)
    except BadInputError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    # what loads is what the recorder writes: dicts of dense tensors and names
    for where in ("optimizer", "update"):
        for t in _tensors(getattr(loaded, where)):
            assert t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_an_update_snapshot_with_an_expanded_gradient_is_refused_naming_the_key(tmp_path, fp16_run):
    from analyzer.errors import BadInputError

    snap = torch.load(fp16_run["snapshots"][0], weights_only=True)
    snap["update"]["grads"]["emb.weight"] = torch.zeros(1).expand(10**8)  # 4 bytes declaring 400 MB
    torch.save(snap, tmp_path / "s.pt")
    with pytest.raises(BadInputError, match=r"update\['grads'\]\['emb.weight'\]"):
        load_snapshot(tmp_path / "s.pt")


# ---------------------------------------------------------------------------- CUDA (skipped without one)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_update_adds_exactly_one_host_sync_per_optimizer_step_on_cuda(tmp_path):
    model = build_mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [{k: v.cuda() for k, v in b.items()} for b in batches(4)]
    syncs = []
    with Recorder(tmp_path, model, optimizer=opt, check_update=True, flush_every=100) as rec:
        for step, batch in enumerate(data):
            rec.begin_step(step, batch)
            loss = mse_loss(model, batch)
            loss.backward()
            rec.end_step(loss)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()  # SGD's own CUDA step never syncs: what is counted is the hook's check
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
            opt.zero_grad(set_to_none=True)
    assert syncs == [1] * 4


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                          | st.text(max_size=10),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                      max_size=4), max_leaves=10),
       where=st.sampled_from(["optimizer", "class", "param_groups", "group", "params", "lr"]))
def test_a_hostile_meta_optimizer_loads_or_fails_with_one_bad_input_error(tmp_path_factory, fp16_run, value, where):
    from analyzer.errors import BadInputError

    meta = json.loads((fp16_run["run_dir"] / schema.META_FILE).read_text())
    opt = meta["optimizer"]
    if where == "optimizer":
        meta["optimizer"] = value
    elif where in ("class", "param_groups"):
        opt[where] = value
    elif where == "group":
        opt["param_groups"][0] = value
    else:
        opt["param_groups"][0][where] = value
    run = tmp_path_factory.mktemp("meta")
    for sub in (schema.TRACE_DIR,):
        (run / sub).mkdir()
        for f in (fp16_run["run_dir"] / sub).iterdir():
            (run / sub / f.name).write_bytes(f.read_bytes())
    (run / schema.META_FILE).write_text(json.dumps(meta))
    try:
        loaded = load_run(run)
    except BadInputError as e:
        assert "\n" not in str(e) and schema.META_FILE in str(e)
        return
    got = loaded.meta["optimizer"]
    assert got is None or all(isinstance(g["params"], list) for g in got["param_groups"])
