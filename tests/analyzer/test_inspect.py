"""analyzer inspect: real checkpoints from tiny models trained a few real steps, with faults injected."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import sysconfig

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from analyzer import inspect as insp
from analyzer import _rangestats, _tensorstats
from analyzer._tensorstats import Workspace, scan_tensor
from analyzer.cli import main
from analyzer.errors import BadInputError, VersionError
from analyzer.inspect import inspect_checkpoints, render_inspect_text
from recorders import schema
from recorders.snapshot import build_snapshot, write_snapshot


def _model() -> nn.Sequential:
    # Linear -> BatchNorm -> ReLU -> Linear: weights, BatchNorm buffers, and a head we can freeze.
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save(path, model, opt, step, **extra):
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, **extra}, path)
    return path


def _trained(tmp_path, name="ckpt.pt", steps=2):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, steps)
    return _save(tmp_path / name, model, opt, steps), model, opt


def _checks(result) -> list[str]:
    return [f.check for f in result.findings]


def _tensor(result, name, file=0):
    return next(t for t in result.files[file].tensors if t.name == name)


# --- layouts ---------------------------------------------------------------------------------

def test_a_healthy_training_checkpoint_has_no_findings_and_names_adam_state_by_parameter(tmp_path):
    path, model, opt = _trained(tmp_path)
    result = inspect_checkpoints(path)
    assert _checks(result) == []
    fr = result.files[0]
    assert fr.ckpt.layout == "training_checkpoint" and fr.ckpt.step == 2
    (o,) = fr.ckpt.optimizers
    # model.parameters() order = state_dict order minus BatchNorm's buffers, and every shape agrees
    assert o.mapping == "order" and o.n_params == 6 and "a guess" in o.note
    w = model[0].weight.detach()
    t = _tensor(result, "model.0.weight")
    assert t.stats.abs_max == w.abs().max().item() and t.stats.min_nonzero == w.abs().min().item()
    state = opt.state[model[0].weight]["exp_avg_sq"]
    assert _tensor(result, "optimizer[model.0.weight].exp_avg_sq").stats.abs_max == state.max().item()
    roles = {t.name: t.role for t in fr.tensors}
    assert roles["model.1.running_var"] == "buffer" and roles["model.1.weight"] == "weight"
    assert fr.ckpt.non_floating == 1  # num_batches_tracked is int64


def test_an_optimizer_built_from_named_parameters_maps_names_exactly(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    _train(model, opt, 1)
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    assert o.mapping == "param_names"
    assert _tensor(result, "optimizer[model.3.bias].exp_avg").param == "model.3.bias"


def test_an_optimizer_over_a_subset_of_parameters_is_not_guessed_and_says_why(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)  # 2 of the 6 parameters
    _train(model, opt, 1)
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    assert o.mapping == "none" and "2 parameters" in o.note and "6 in 'model'" in o.note
    assert _tensor(result, "optimizer[0].exp_avg_sq").param == "0"


def test_a_lightning_style_checkpoint_is_found_by_shape_with_its_global_step(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    torch.save({"epoch": 0, "global_step": 5, "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()], "lr_schedulers": []}, tmp_path / "last.ckpt")
    fr = inspect_checkpoints(tmp_path / "last.ckpt").files[0]
    assert (fr.ckpt.step, fr.ckpt.step_key) == (5, "global_step")  # global_step wins over epoch
    (o,) = fr.ckpt.optimizers
    assert o.path == "optimizer_states.0" and o.mapping == "order"
    assert "optimizer_states.0[state_dict.0.weight].exp_avg_sq" in {t.name for t in fr.tensors}


def test_an_optimizer_saved_alone_keeps_integer_ids_and_says_there_is_no_model(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 1)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")  # how HF Trainer saves it
    fr = inspect_checkpoints(tmp_path / "optimizer.pt").files[0]
    (o,) = fr.ckpt.optimizers
    assert o.mapping == "none" and "no model state_dict in the file" in o.note
    assert _tensor(inspect_checkpoints(tmp_path / "optimizer.pt"), "optimizer[0].exp_avg").param == "0"


def test_tied_weights_count_once_when_mapping_optimizer_ids_by_order(tmp_path):
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss = head(emb(torch.tensor([1, 2]))).sum()
    loss.backward()
    opt.step()
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 1))
    (o,) = result.files[0].ckpt.optimizers
    # the state_dict holds emb.weight and head.weight (one storage); parameters() yields it once
    assert o.mapping == "order" and o.n_params == 1
    assert [t.name for t in result.files[0].tensors if t.role == "optimizer"] == [
        "optimizer[model.emb.weight].momentum_buffer"]


def test_a_plain_state_dict_and_a_lone_tensor_are_accepted(tmp_path):
    model = _model()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    torch.save(torch.ones(3), tmp_path / "t.pt")
    sd = inspect_checkpoints(tmp_path / "sd.pt").files[0]
    assert sd.ckpt.layout == "state_dict" and [t.name for t in sd.tensors][:2] == ["0.weight", "0.bias"]
    lone = inspect_checkpoints(tmp_path / "t.pt").files[0]
    assert lone.ckpt.layout == "tensor" and lone.tensors[0].stats.abs_max == 1.0


def test_empty_float8_parameter_and_sparse_tensors_are_scanned_or_skipped_not_crashed_on(tmp_path):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    torch.save({"empty": torch.empty(0, 3), "f8": torch.tensor([0.5, -3.0]).to(torch.float8_e4m3fn),
                "param": nn.Parameter(torch.full((2,), 7.0)), "sparse": sparse}, tmp_path / "c.pt")
    fr = inspect_checkpoints(tmp_path / "c.pt").files[0]
    stats = {t.name: t.stats for t in fr.tensors}
    assert fr.ckpt.non_floating == 1 and set(stats) == {"empty", "f8", "param"}  # sparse is skipped
    assert stats["empty"].abs_max is None and stats["f8"].abs_max == 3.0 and stats["param"].abs_max == 7.0


def test_a_legacy_non_zip_torch_file_is_read_without_mmap(tmp_path):
    model = _model()
    torch.save(model.state_dict(), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    fr = inspect_checkpoints(tmp_path / "old.pt").files[0]
    assert fr.ckpt.format == "torch-legacy"
    assert _tensor(inspect_checkpoints(tmp_path / "old.pt"), "3.weight").stats.abs_max == (
        model[3].weight.abs().max().item())


def test_a_recorder_snapshot_is_inspected_with_its_batch_as_inputs(tmp_path):
    model = _model()
    batch = {"x": torch.randn(4, 4)}
    batch["x"][1, 2] = float("nan")
    snap = build_snapshot(step=7, reason="nonfinite_loss", model=model, batch=batch,
                          rng={"cpu": torch.get_rng_state(), "cuda": None}, factory="m:f", factory_kwargs={},
                          loss_fn="m:l", amp_dtype=torch.float16, device_type="cpu", scale=1024.0,
                          scaler_state={"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                        "growth_interval": 2000, "_growth_tracker": 3})
    path = write_snapshot(tmp_path / schema.snapshot_name(7, 0, "nonfinite_loss"), snap)
    result = inspect_checkpoints(path)
    fr = result.files[0]
    assert fr.ckpt.layout == "snapshot" and fr.ckpt.step == 7 and fr.ckpt.scaler["scale"] == 1024.0
    assert _tensor(result, "batch.x").role == "input"
    (f,) = result.findings
    assert f.check == "nonfinite_inputs" and f.step == 7 and "batch.x (1 of 16 values)" in f.message


def test_a_snapshot_from_a_newer_format_is_refused_with_the_upgrade_fix(tmp_path):
    model = _model()
    snap = build_snapshot(step=1, reason="manual", model=model, batch={}, rng={}, factory="m:f",
                          factory_kwargs={}, loss_fn="m:l", amp_dtype=None, device_type="cpu")
    snap["format_version"] = schema.FORMAT_VERSION + 1
    torch.save(snap, tmp_path / "s.pt")
    with pytest.raises(VersionError, match="pip install -U amp-autopsy"):
        inspect_checkpoints(tmp_path / "s.pt")


def test_a_noncontiguous_saved_tensor_gives_the_stats_of_its_values(tmp_path):
    x = torch.randn(30, 20) * 1e4
    torch.save({"w": x.t()}, tmp_path / "t.pt")  # saved with transposed strides
    s = _tensor(inspect_checkpoints(tmp_path / "t.pt"), "w").stats
    assert s.abs_max == x.abs().max().item() and s.fp16_overflow == int((x.abs() >= 65520).sum())


# --- statistics against real casts -----------------------------------------------------------

# Every statistics test runs on both scans: the compiled one (analyzer/_scan.c) and the numpy one.
KERNELS = ["c", "numpy"] if _tensorstats.KERNEL == "c" else ["numpy"]


def test_the_compiled_scan_is_built_wherever_a_c_compiler_is_present():
    # pip install builds analyzer/_scan.c when it can (optional=true): CI must not quietly lose it
    compiler = sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        pytest.skip(f"no C compiler ({compiler}): the numpy scan is the only one")
    assert _tensorstats.KERNEL == "c", "analyzer._scan did not build: run pip install -e . and read its log"


_WITHOUT_SCAN = """
import json, sys

class NoCompiledScan:  # as if pip had found no C compiler: analyzer._scan cannot be imported
    def find_spec(self, name, path=None, target=None):
        if name == "analyzer._scan":
            raise ImportError("not built")

sys.meta_path.insert(0, NoCompiledScan())
from analyzer import _rangestats, _tensorstats
from analyzer.inspect import inspect_checkpoints
try:
    _tensorstats.Workspace(kernel="c")
except ValueError as e:
    refused = str(e)
print(json.dumps({"kernel": _tensorstats.KERNEL, "refused": refused,
                  "result": inspect_checkpoints(sys.argv[1], sys.argv[2]).to_dict()}))
"""


def test_without_the_compiled_scan_inspect_falls_back_to_numpy_with_the_same_report(tmp_path):
    a, _, _ = _trained(tmp_path, "a.pt", steps=2)
    b, _, _ = _trained(tmp_path, "b.pt", steps=3)
    out = subprocess.run([sys.executable, "-c", _WITHOUT_SCAN, str(a), str(b)], capture_output=True, text=True,
                         check=True).stdout
    got = json.loads(out)
    assert got["kernel"] == "numpy" and "was not compiled at install" in got["refused"]
    want = json.loads(json.dumps(inspect_checkpoints(a, b).to_dict()))
    # The same report, except the relative change: float32 dot products in numpy, float64 sums in the kernel
    rel = [(c["rel_change"], w["rel_change"]) for c, w in zip(got["result"]["diff"]["changes"],
                                                                want["diff"]["changes"])]
    assert rel and all(g == pytest.approx(w, rel=1e-5) for g, w in rel)
    for r in (got["result"], want):
        for c in r["diff"]["changes"]:
            c["rel_change"] = None
    assert got["result"] == want


def test_a_workspace_refuses_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel must be 'c' or 'numpy'"):
        Workspace(kernel="cuda")

def _edge_values() -> torch.Tensor:
    # log-uniform magnitudes over the whole float32 range plus every cast boundary and its neighbours
    mags = torch.exp(torch.empty(20_000).uniform_(-100, 88))
    signs = torch.where(torch.rand(20_000) < 0.5, -1.0, 1.0)
    edges = torch.tensor([2.0**-25, 2.0**-24, 65504.0, 65520.0, 2.0**-134, 2.0**-133, (2 - 2.0**-8) * 2.0**127])
    down, up = torch.nextafter(edges, torch.zeros(7)), torch.nextafter(edges, torch.full((7,), torch.inf))
    near = torch.cat([edges, down, up])
    return torch.cat([mags * signs, near, torch.zeros(5), torch.tensor([float("nan"), float("inf"), -float("inf")])])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("chunk", [1000, 1 << 18])  # many chunks with a ragged tail, and one chunk
@pytest.mark.parametrize("signs", ["mixed", "non-negative"])  # non-negative skips the abs pass
def test_flush_and_overflow_counts_equal_what_a_real_fp16_and_bf16_cast_does(chunk, signs, kernel):
    x = _edge_values() if signs == "mixed" else _edge_values().abs()
    s = scan_tensor(x, Workspace(chunk, kernel=kernel))
    fin = x[torch.isfinite(x)]
    h, b = fin.half(), fin.bfloat16()
    assert (s.nan, s.inf, s.zeros) == (1, 2, 5)  # as built by _edge_values
    assert s.fp16_overflow == int(torch.isinf(h).sum())
    assert s.fp16_flush == int(((h == 0) & (fin != 0)).sum())
    assert s.bf16_overflow == int(torch.isinf(b).sum())
    assert s.bf16_flush == int(((b == 0) & (fin != 0)).sum())
    assert s.abs_max == fin.abs().max().item()
    assert s.min_nonzero == fin.abs()[fin != 0].min().item()
    assert s.fp16_flush > 0 and s.fp16_overflow > 0 and s.bf16_flush > 0  # the test exercises each


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("scale", [2.0**-26, 2.0**-135])  # all below FP16's flush point; also below BF16's
def test_chunks_whose_every_nonzero_value_flushes_are_counted_without_a_pass_and_exactly(scale, kernel):
    x = torch.rand(5000) * scale
    x[::7] = 0.0
    s = scan_tensor(x, Workspace(1000, kernel=kernel))
    nonzero = int((x != 0).sum())
    assert s.zeros == 5000 - nonzero and s.min_nonzero == x[x != 0].min().item()
    assert s.fp16_flush == int(((x.half() == 0) & (x != 0)).sum()) == nonzero
    assert s.bf16_flush == int(((x.bfloat16() == 0) & (x != 0)).sum())


def _expected(x: torch.Tensor) -> dict:
    """What real casts do to x: the reference every scan path must equal."""
    fin = x[torch.isfinite(x)]
    h, b = fin.half(), fin.bfloat16()
    nz = fin.abs()[fin != 0]
    return {"nan": int(x.isnan().sum()), "inf": int(x.isinf().sum()), "zeros": int((x == 0).sum()),
            "abs_max": fin.abs().max().item() if fin.numel() else None,
            "min_nonzero": nz.min().item() if nz.numel() else None,
            "fp16_overflow": int(h.isinf().sum()), "fp16_flush": int(((h == 0) & (fin != 0)).sum()),
            "bf16_overflow": int(b.isinf().sum()), "bf16_flush": int(((b == 0) & (fin != 0)).sum())}


_ODD = {  # one value planted in healthy weights, |x| in [0.5, 1.5): which path it must send its chunk down
    "none": None,                        # fast path: four integer extremes decide everything
    "inf": float("inf"),                 # float path (bits >= the overflow bits)
    "nan": float("nan"),
    "above 65520": 65520.0,              # float path: the smallest value that becomes inf in FP16
    "just below 65520": 65519.996,       # fast path: rounds down to 65504
    "at 2**-25": 2.0**-25,               # counting: flushes (ties to even)
    "just above 2**-25": 2.0**-25 * (1 + 2.0**-23),  # counting: survives as the smallest FP16 subnormal
    "bf16 subnormal": 1e-40,             # counting: flushes in FP16 and BF16
    "zero": 0.0,                         # zero counting, then the smallest non-zero among the rest
    "negative zero": -0.0,
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("odd", list(_ODD))
@pytest.mark.parametrize("signs", ["mixed", "non-negative"])  # non-negative chunks skip the uint32 extremes
@pytest.mark.parametrize("chunk, threads", [(1 << 17, 1), (1 << 15, 2)])  # large chunks; split in 2 parts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # 16-bit kernel paths too
def test_one_odd_value_in_healthy_weights_is_counted_exactly_by_every_path(odd, signs, chunk, threads, kernel,
                                                                           dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.rand(1 << 20, generator=g) + 0.5
    if signs == "mixed":
        x *= torch.where(torch.rand(1 << 20, generator=g) < 0.5, -1.0, 1.0)
    x = x.to(dtype)
    if _ODD[odd] is not None:
        x[700_001] = _ODD[odd]  # in the 6th of 8 chunks of 128K, in the second part of 2 (bf16: rounded)
    with Workspace(chunk, threads, kernel=kernel) as ws:
        s = scan_tensor(x, ws)
    assert {k: getattr(s, k) for k in _expected(x)} == _expected(x)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_flush_counts_stay_exact_across_chunks_that_switch_between_counting_and_not(kernel, dtype):
    # Segments of the compiled scan's block, also the numpy chunk here: 1 healthy, 2 and 3 with
    # flushing values (the second with zeros, so the kernel's fused count must subtract them), 4 healthy
    # again (after a counting block the kernel fuses the count: it must find none), 5 flushing after a
    # healthy one, 6 NaN among flushing values right after counting ones.
    n = _rangestats._scan.BLOCK if _rangestats.compiled() else 8192
    x = (torch.rand(6 * n) + 0.5) * torch.where(torch.rand(6 * n) < 0.5, -1.0, 1.0)
    x[n:2 * n:7] = 1e-9
    x[2 * n:3 * n:5] = -3e-8
    x[2 * n:3 * n:11] = 0.0
    x[2 * n + 500] = -1e-41
    x[2 * n + 600], x[2 * n + 601] = 2.0**-25, -(2.0**-25) * (1 + 2.0**-23)  # at the threshold, one step above
    x[4 * n + 9] = 2.0**-25
    x[5 * n:6 * n:3] = 1e-8
    x[5 * n + 1], x[5 * n + 2] = float("nan"), -float("inf")
    x = x.to(dtype)  # bf16/fp16: the same blocks, values rounded (in fp16 the tiny ones become 0)
    s = scan_tensor(x, Workspace(n, threads=1, kernel=kernel))
    assert {k: getattr(s, k) for k in _expected(x)} == _expected(x)


def test_the_kernel_converts_every_finite_float16_magnitude_exactly():
    # scan_f16 reports its extremes as float32 bit patterns, converted in C: all 31744 finite
    # magnitudes (1023 subnormals among them), each alone, against torch's own conversion
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    bits = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16)
    want = bits.view(torch.float16).float().view(torch.int32).tolist()
    limits = _rangestats._KERNEL_LIMITS
    got = [_rangestats._scan.scan_f16(b, *limits)[:2] for b in bits.numpy().reshape(-1, 1)]
    assert [hi for hi, _ in got] == want
    assert [lo for _, lo in got] == [-1] + want[1:]  # a lone zero has no non-zero magnitude


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_adam_moments_flush_in_every_block_and_are_counted_exactly(kernel, dtype, moment):
    # Every block has FP16 flushes, so after the first the kernel counts them inside its extremes pass
    # (bf16: in 16 bits); second moments flush entirely, so no block needs a count at all
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5 * 8192 + 13, generator=g) * 1e-7  # about a quarter of |x| <= 2**-25
    x = x.square().add_(2.0**-40) if moment == "exp_avg_sq" else x
    x = x.to(dtype)
    assert (x == 0).sum() == 0 and x.isfinite().all()  # no zero or NaN sends a block down another path
    s = scan_tensor(x, Workspace(8192, threads=1, kernel=kernel))
    assert {k: getattr(s, k) for k in _expected(x)} == _expected(x)
    assert 0 < s.fp16_flush <= x.numel() and (s.fp16_flush == x.numel()) == (moment == "exp_avg_sq")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_and_numpy_scans_agree_on_random_mixtures_of_every_kind_of_value(seed, dtype):
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    g = torch.Generator().manual_seed(seed)
    n = 50_000 + seed * 997  # about 12 kernel blocks, ragged tail
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-45, 39, (n,), generator=g).float()
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 65520.0, -65504.0, 2.0**-25,
                         1e-45, -(2.0**-134), 3.4e38])
    where = torch.randint(0, n, (200 * seed,), generator=g)
    x[where] = pool[torch.randint(0, len(pool), where.shape, generator=g)]
    x = x.to(dtype)
    c = scan_tensor(x, Workspace(1000, threads=1, kernel="c"))
    assert c == scan_tensor(x, Workspace(1000, threads=1, kernel="numpy"))
    assert {k: getattr(c, k) for k in _expected(x)} == _expected(x)


def _build_scan(tmp_path, flags: list[str]):
    """analyzer/_scan.c compiled here with `flags` and without per-CPU clones, loaded as a module."""
    src = Path(_rangestats.__file__).with_name("_scan.c")
    out = tmp_path / ("_scan" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    cmd = [*cc, "-O3", "-fwrapv", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
           "-DAMP_AUTOPSY_NO_CLONES", *flags, str(src), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("_scan", out)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kernel_refuses_misaligned_or_ragged_buffers_rather_than_reading_them():
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    raw = np.zeros(64, dtype=np.uint8)
    limits = _rangestats._KERNEL_LIMITS
    with pytest.raises(ValueError, match="not aligned to its 4-byte items"):
        _rangestats._scan.scan_f32(np.frombuffer(raw, np.float32, 4, 2), *limits)  # 4 floats from byte 2
    with pytest.raises(ValueError, match="not aligned to its 2-byte items"):
        _rangestats._scan.scan_f16(np.frombuffer(raw, np.int16, 4, 1), *limits)
    with pytest.raises(ValueError, match="not a multiple of 4 bytes"):
        _rangestats._scan.scan_f32(raw[:6], *limits)
    four = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="A and B differ in length"):
        _rangestats._scan.scan_pair_f32(four, np.zeros(5, np.float32), *limits)
    with pytest.raises(ValueError, match="not aligned to its 4-byte items"):
        _rangestats._scan.scan_pair_f32(four, np.frombuffer(raw, np.float32, 4, 2), *limits)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512f"])
def test_every_instruction_set_copy_of_the_kernel_gives_the_same_numbers(tmp_path, isa):
    # The installed kernel runs the copy for this CPU (x86-64-v4 here); the others only run elsewhere,
    # so they are built and checked here against it, on every kind of value
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    if isa != "baseline" and isa not in Path("/proc/cpuinfo").read_text(errors="replace"):
        pytest.skip(f"this CPU has no {isa}")
    flags = {"baseline": [], "avx2": ["-mavx2"], "avx512f": ["-mavx512f"]}[isa]  # avx512f: clang's clone
    if platform.machine() not in ("x86_64", "AMD64"):
        flags = []
    mod = _build_scan(tmp_path, flags)
    g = torch.Generator().manual_seed(3)
    n = 3 * mod.BLOCK + 77
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-45, 39, (n,), generator=g).float()
    odd = torch.tensor([0.0, float("nan"), -float("inf"), 65520.0, 2.0**-25, 1e-45])
    x[::501] = odd.repeat(20)[: len(x[::501])]
    x[mod.BLOCK:2 * mod.BLOCK] = torch.rand(mod.BLOCK, generator=g) * 1e-4  # a block of flushes, then a fused one
    limits = _rangestats._KERNEL_LIMITS
    for part in (x, x[5:], x[: mod.BLOCK], x[:7]):  # ragged tails, one block, fewer values than lanes
        a, b, h = (part.numpy(), part.bfloat16().view(torch.int16).numpy(),
                   part.half().view(torch.int16).numpy())
        assert mod.scan_f32(a, *limits) == _rangestats._scan.scan_f32(a, *limits)
        assert mod.scan_bf16(b, *limits) == _rangestats._scan.scan_bf16(b, *limits)
        assert mod.scan_f16(h, *limits) == _rangestats._scan.scan_f16(h, *limits)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_workspace_splits_large_tensors_between_threads_and_restores_torch_threads(kernel):
    before = torch.get_num_threads()
    x = _edge_values()
    with Workspace(500, threads=3, kernel=kernel) as ws:  # 20029 values: 3 parts of 7000, 7000 and 6029
        assert torch.get_num_threads() == 1  # the scan's own threads replace torch's
        assert len(ws.parts(x.numel())) == 3 and ws.parts(x.numel())[-1][1] == x.numel()
        split = scan_tensor(x, ws)
        bf16 = scan_tensor(x.bfloat16(), ws)  # converted chunks, one scratch per thread
    assert torch.get_num_threads() == before
    assert split == scan_tensor(x, Workspace(1000, threads=1, kernel=kernel))
    assert bf16 == scan_tensor(x.bfloat16(), Workspace(1000, threads=1, kernel=kernel))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_tensors_scanned_side_by_side_give_each_its_own_statistics_in_order(kernel, threads):
    g = torch.Generator().manual_seed(11)
    ts = [torch.randn(n, generator=g) * 10.0 ** e for n, e in [(5000, 0), (30_000, -9), (7, 4), (0, 0), (64_000, 6)]]
    ts[1][3] = float("nan")
    ts += [ts[0].bfloat16(), ts[4].double(), _edge_values()]
    seen = []
    # split_at 20000: the 30000-, 64000- and 20029-value tensors are split between threads, the rest are
    # scanned whole, side by side; progress comes in order, tensor by tensor
    with Workspace(1000, threads=threads, kernel=kernel, split_at=20_000) as ws:
        got = _tensorstats.scan_tensors(ts, ws, seen.append)
        assert got == [scan_tensor(t, ws) for t in ts]
    assert [{k: getattr(s, k) for k in _expected(t)} for s, t in zip(got, ts)] == [_expected(t) for t in ts]
    assert sum(seen) == sum(t.nbytes for t in ts)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_float_dtypes_are_scanned_exactly(dtype, kernel):
    x = _edge_values().to(dtype)
    s = scan_tensor(x, Workspace(1000, kernel=kernel))
    fin = x[torch.isfinite(x)].double()
    assert s.nonfinite == int((~torch.isfinite(x)).sum())
    assert s.abs_max == fin.abs().max().item()
    assert s.fp16_overflow == int((fin.abs() >= 65520).sum())


# --- findings --------------------------------------------------------------------------------

def test_nan_and_inf_injected_in_adam_exp_avg_sq_are_nonfinite_optimizer_state_naming_the_parameter(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    state = opt.state[model[0].weight]["exp_avg_sq"]
    state[0, :3] = float("nan")
    state[1, 0] = float("inf")
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 2))
    (f,) = result.findings
    assert f.check == "nonfinite_optimizer_state" and f.severity == "error" and f.step == 2
    assert f.evidence["tensors"] == [{"name": "optimizer[model.0.weight].exp_avg_sq", "nan": 3, "inf": 1,
                                      "numel": 32}]  # 3 NaN + 1 inf injected into the 8x4 state


def test_a_forward_pass_on_a_nan_batch_poisons_batchnorm_running_stats_and_is_named(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    with torch.no_grad():  # what a step that GradScaler later skips still does to BatchNorm
        model(torch.full((16, 4), float("nan")))
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 3))
    (f,) = result.findings
    assert f.check == "nonfinite_buffers"
    assert {t["name"] for t in f.evidence["tensors"]} == {"model.1.running_mean", "model.1.running_var"}
    assert all(t["nan"] == 8 for t in f.evidence["tensors"])  # every one of the 8 channels


def test_a_frozen_layer_is_stalled_between_two_checkpoints_and_has_no_adam_state(tmp_path):
    model = _model()
    model[3].requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    a = _save(tmp_path / "a.pt", model, opt, 2)
    _train(model, opt, 2)
    b = _save(tmp_path / "b.pt", model, opt, 4)
    result = inspect_checkpoints(a, b)
    stalled = sorted(c.name for c in result.changes if c.change.stalled)
    assert stalled == ["model.3.bias", "model.3.weight"]
    assert not [c for c in result.changes if c.became_nonfinite]
    moved = next(c for c in result.changes if c.name == "model.0.weight")
    ref = (model[0].weight - torch.load(a)["model"]["0.weight"]).norm() / torch.load(a)["model"]["0.weight"].norm()
    assert moved.change.rel_change == pytest.approx(ref.item(), rel=1e-5)
    dead = {"no_state" if "no_state" in f.evidence else "stalled": f.evidence
            for f in result.findings if f.check == "dead_optimizer_state"}
    # two findings: B has no Adam state for the head, and the head never moved A -> B
    assert dead["no_state"]["no_state"] == ["model.3.weight", "model.3.bias"]
    assert dead["stalled"]["stalled"] == ["model.3.weight", "model.3.bias"]


def test_weights_that_became_nonfinite_between_a_and_b_are_listed_as_such(tmp_path):
    path_a, model, opt = _trained(tmp_path, "a.pt")
    with torch.no_grad():
        model[0].weight[2, 1] = float("nan")
    path_b = _save(tmp_path / "b.pt", model, opt, 3)
    result = inspect_checkpoints(path_a, path_b)
    assert [c.name for c in result.changes if c.became_nonfinite] == ["model.0.weight"]
    (f,) = [f for f in result.findings if f.check == "nonfinite_weights"]
    assert f.message.startswith("b.pt: ") and f.evidence["tensors"][0]["finite_in_a"] is True


def test_a_pair_with_different_dtypes_is_compared_value_by_value(tmp_path):
    sd = {"w": torch.randn(300, 7)}
    torch.save(sd, tmp_path / "a.pt")
    torch.save({"w": sd["w"].bfloat16()}, tmp_path / "b.pt")
    (c,) = inspect_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt").changes
    # bf16 keeps 8 significant bits: each value moves by at most 2**-9 of itself, so the L2 change does too
    assert 0 < c.change.rel_change <= 2.0**-9 and c.change.changed > 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_pair_scan_gives_each_side_the_statistics_of_a_single_scan(kernel):
    a = _edge_values()
    b = a.clone()
    b[:5000] *= 3.0  # some values move, some become inf or flush differently
    b[7] = float("nan")
    with Workspace(1000, threads=1, kernel=kernel) as ws:
        sa, sb, change = _tensorstats.scan_pair(a, b, ws)
        assert (sa, sb) == (scan_tensor(a, ws), scan_tensor(b, ws))
    assert {k: getattr(sb, k) for k in _expected(b)} == _expected(b)
    # NaN != NaN, so the unchanged NaN and the new one both count as changed; x * 3 == x only for 0
    assert change.changed == int((a != b).sum()) and change.rel_change is None  # B holds NaN


def test_the_kernel_pair_scan_counts_changes_like_float_compares_and_sums_in_float64():
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    g = torch.Generator().manual_seed(9)
    a = torch.randn(3 * 8192 + 5, generator=g) * 1e3
    b = a + torch.randn(a.shape, generator=g) * 1e-3
    b[:100] = a[:100]  # unchanged
    a[200], b[200] = 0.0, -0.0  # equal as floats: not a change
    a[201] = b[201] = float("nan")  # NaN != NaN: a change, as in numpy
    limits = _rangestats._KERNEL_LIMITS
    changed, dd, aa = _rangestats._scan.scan_pair_f32(a.numpy(), b.numpy(), *limits)[2:]
    assert changed == int((a != b).sum())
    fin = torch.isfinite(a)
    a64, b64 = a[fin].double(), b[fin].double()
    assert math.isnan(dd) and math.isnan(aa)  # the NaN reaches both sums, so inspect reports no rel_change
    _, dd2, aa2 = _rangestats._scan.scan_pair_f32(a[fin].numpy(), b[fin].numpy(), *limits)[2:]
    assert dd2 == pytest.approx(float(((b64 - a64) ** 2).sum()), rel=1e-12)
    assert aa2 == pytest.approx(float((a64 ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("threads", [1, 3])
def test_many_pairs_scanned_side_by_side_give_what_one_pair_at_a_time_gives(kernel, threads):
    g = torch.Generator().manual_seed(4)
    pairs = []
    for n, dtype in [(5000, torch.float32), (20_029, torch.bfloat16), (7, torch.float16), (0, torch.float32),
                     (12_000, torch.float64)]:
        a = torch.randn(n, generator=g).to(dtype)
        b = a.clone()
        b[: n // 3] *= 2
        pairs.append((a, b))
    pairs.append((_edge_values(), _edge_values().flip(0)))
    seen = []
    with Workspace(1000, threads=threads, kernel=kernel) as ws:
        got = _tensorstats.scan_pairs(pairs, ws, seen.append)
        assert got == [_tensorstats.scan_pair(a, b, ws) for a, b in pairs]
    assert sum(seen) == sum(a.nbytes + b.nbytes for a, b in pairs)
    assert [c.changed for _, _, c in got][:3] == [5000 // 3, 20_029 // 3, 7 // 3]  # x * 2 != x unless 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_pair_saved_in_different_memory_layouts_is_compared_value_by_value(tmp_path, monkeypatch, kernel):
    monkeypatch.setattr(_tensorstats, "KERNEL", kernel)
    x = torch.randn(300, 70)
    torch.save({"w": x.t().contiguous().t()}, tmp_path / "a.pt")  # the same values, stored column-major
    y = x.clone()
    y[5, 7] += 1.0
    torch.save({"w": y}, tmp_path / "b.pt")
    (c,) = inspect_checkpoints(tmp_path / "a.pt", tmp_path / "b.pt").changes
    assert c.change.changed == 1  # in memory order the two would differ almost everywhere
    assert c.change.rel_change == pytest.approx(1.0 / x.norm().item(), rel=1e-5)


def test_the_kernel_gives_the_relative_change_of_huge_values_whose_float32_squares_overflow():
    if "c" not in KERNELS:
        pytest.skip("analyzer._scan is not built here")
    a = torch.randn(10_000) * 1e30  # squares near 1e60: inf in float32, fine in the kernel's float64 sums
    with Workspace(1000, threads=1, kernel="c") as ws:
        assert _tensorstats.scan_pair(a, a * 1.5, ws)[2].rel_change == pytest.approx(0.5, rel=1e-6)
    with Workspace(1000, threads=1, kernel="numpy") as ws:
        assert _tensorstats.scan_pair(a, a * 1.5, ws)[2].rel_change is None  # the fallback's float32 dots


def test_identical_checkpoints_are_called_out_rather_than_listing_every_tensor_as_stalled(tmp_path):
    path, _, _ = _trained(tmp_path)
    result = inspect_checkpoints(path, path)
    (f,) = [f for f in result.findings if f.check == "dead_optimizer_state"]
    assert "bit-identical" in f.message and f.evidence["compared"] == len(result.changes)


def test_a_parameter_whose_gradient_is_always_zero_has_an_all_zero_second_moment(tmp_path):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):  # unused gets a gradient tensor, but it is exactly zero
            return self.used(x) + 0.0 * self.unused(x)

    model = Model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
    result = inspect_checkpoints(_save(tmp_path / "c.pt", model, opt, 2))
    (f,) = result.findings
    assert f.check == "dead_optimizer_state"
    assert f.evidence["zero_second_moment"] == ["optimizer[model.unused.weight].exp_avg_sq",
                                                "optimizer[model.unused.bias].exp_avg_sq"]


def test_fp16_range_risk_flags_overflowing_values_and_large_products_but_not_a_default_init(tmp_path):
    model = nn.Sequential(nn.Linear(256, 4), nn.Linear(256, 4), nn.Linear(4, 256))
    with torch.no_grad():
        model[0].weight[0, 0] = 7e4          # above 65520: a cast to FP16 gives inf
        model[1].weight.uniform_(-100, 100)  # abs-max ~100 * sqrt(fan_in 256) = ~1600 > 65504/64 = 1023.5
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    (f,) = inspect_checkpoints(tmp_path / "sd.pt").findings
    assert f.check == "fp16_range_risk" and f.severity == "warning"
    reasons = {t["name"]: t["reason"] for t in f.evidence["tensors"]}
    assert reasons == {"0.weight": "value_overflow", "1.weight": "product_overflow"}
    assert "first-order signal" in f.message
    # the product estimate is abs-max * sqrt(256) = 16 * abs-max
    est = next(t["value"] for t in f.evidence["tensors"] if t["name"] == "1.weight")
    assert est == pytest.approx(16 * model[1].weight.abs().max().item())


def test_weights_that_mostly_flush_to_zero_in_fp16_are_a_range_risk(tmp_path):
    torch.save({"w": torch.randn(8, 8) * 1e-9, "ok": torch.randn(8, 8)}, tmp_path / "sd.pt")
    (f,) = inspect_checkpoints(tmp_path / "sd.pt").findings
    (t,) = f.evidence["tensors"]
    # |N(0, 1e-9)| <= 2**-25 ~ 2.98e-8 for essentially every value: the whole tensor becomes zero
    assert t["name"] == "w" and t["reason"] == "underflow" and t["value"] == 1.0


# --- safetensors -----------------------------------------------------------------------------

def _write_safetensors(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The format by hand: u64 LE header size, JSON header, little-endian data (8-byte padded header)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int8: "I8"}
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_a_hand_written_safetensors_file_with_bf16_and_metadata_is_read(tmp_path):
    w = torch.randn(6, 5)
    w[0, 0] = 1e5
    tensors = {"w": w, "h": torch.randn(7).bfloat16(), "ids": torch.arange(3)}
    _write_safetensors(tmp_path / "m.safetensors", tensors, {"format": "pt"})
    fr = inspect_checkpoints(tmp_path / "m.safetensors").files[0]
    assert fr.ckpt.layout == "safetensors" and fr.ckpt.metadata == {"format": "pt"} and fr.ckpt.non_floating == 1
    stats = {t.name: t for t in fr.tensors}
    assert stats["w"].stats.abs_max == 1e5 and stats["w"].stats.fp16_overflow == 1
    assert stats["h"].dtype == "bfloat16" and stats["h"].stats.abs_max == tensors["h"].abs().max().item()


@pytest.mark.parametrize("kernel", KERNELS)
def test_tensors_that_start_at_odd_offsets_in_a_safetensors_file_are_scanned_exactly(tmp_path, monkeypatch, kernel):
    # safetensors packs tensors back to back: float32 "w" starts 2 bytes off its 4-byte alignment (after
    # 3 bf16 values) and float16 "h" 1 byte off its 2 (past the int8); the reader copies such a tensor,
    # so the kernel always gets aligned data
    monkeypatch.setattr(_tensorstats, "KERNEL", kernel)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(70_001, generator=g) * 0.02
    w[5], w[60_000], w[61_000] = float("nan"), 1e-9, 7e4
    h = (torch.randn(20_003, generator=g) * 1e4).half()
    h[3] = 0.0
    tensors = {"a": torch.tensor([1.0, -2.0, 3.0]).bfloat16(), "w": w, "b": torch.tensor([0.5]).bfloat16(),
               "odd": torch.ones(1, dtype=torch.int8), "h": h}
    _write_safetensors(tmp_path / "m.safetensors", tensors, {})
    stats = {t.name: t.stats for t in inspect_checkpoints(tmp_path / "m.safetensors").files[0].tensors}
    for name in ("a", "w", "b", "h"):
        assert {k: getattr(stats[name], k) for k in _expected(tensors[name])} == _expected(tensors[name]), name


def test_the_safetensors_package_and_torch_save_give_identical_stats(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd = _model().state_dict()
    sd = {k: v for k, v in sd.items() if v.is_floating_point()}
    st.save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "m.pt")
    a = inspect_checkpoints(tmp_path / "m.safetensors").files[0]
    b = inspect_checkpoints(tmp_path / "m.pt").files[0]
    assert {t.name: t.to_dict() for t in a.tensors} == {t.name: t.to_dict() for t in b.tensors}


@pytest.mark.parametrize("mangle, expect", [
    (lambda raw: raw[: len(raw) - 10], "truncated"),
    (lambda raw: struct.pack("<Q", 12) + b"{not json!!}" + raw[8:], "not JSON"),
    (lambda raw: raw.replace(b'"F32"', b'"F99"'), "unknown dtype 'F99'"),
])
def test_broken_safetensors_files_are_one_line_errors(tmp_path, mangle, expect):
    _write_safetensors(tmp_path / "ok.safetensors", {"w": torch.randn(4)}, {})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mangle((tmp_path / "ok.safetensors").read_bytes()))
    with pytest.raises(BadInputError, match=expect) as e:
        inspect_checkpoints(bad)
    assert "bad.safetensors" in str(e.value) and "\n" not in str(e.value)


# --- bad input and the command line ----------------------------------------------------------

def test_a_truncated_checkpoint_is_a_one_line_error(tmp_path):
    path, _, _ = _trained(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(BadInputError, match="truncated, corrupt or foreign"):
        inspect_checkpoints(path)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_code_and_modules_are_refused_without_running_anything(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"model": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(BadInputError, match="refused") as e:
        inspect_checkpoints(tmp_path / "evil.pt")
    assert not marker.exists()
    assert "state_dict" in str(e.value)  # the safe alternative
    torch.save(_model(), tmp_path / "module.pt")
    with pytest.raises(BadInputError, match="refused: the file holds pickled Python objects"):
        inspect_checkpoints(tmp_path / "module.pt")


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")  # script and save, both deprecated
def test_torchscript_and_export_archives_are_refused_as_programs_not_checkpoints(tmp_path):
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), tmp_path / "ts.pt")
    torch.export.save(torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),)), tmp_path / "ep.pt2")
    with pytest.raises(BadInputError, match=r"refused: a TorchScript archive .* \(torch.save\(model.state_dict\(\)\)"):
        inspect_checkpoints(tmp_path / "ts.pt")
    with pytest.raises(BadInputError, match="refused: a torch.export archive"):
        inspect_checkpoints(tmp_path / "ep.pt2")


def test_a_file_without_floating_point_tensors_is_an_unknown_layout(tmp_path):
    torch.save({"epoch": 3, "ids": torch.arange(4)}, tmp_path / "c.pt")
    expect = r"unknown layout: no floating-point tensors found \(top level: \['epoch', 'ids'\]\)"
    with pytest.raises(BadInputError, match=expect):
        inspect_checkpoints(tmp_path / "c.pt")


def test_the_cli_prints_strict_json_and_text_worst_first(tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    opt.state[model[3].weight]["exp_avg_sq"].fill_(float("nan"))
    path = _save(tmp_path / "c.pt", model, opt, 2, scaler={"scale": float("inf"), "growth_factor": 2.0,
                                                           "_growth_tracker": 0})
    res = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert doc["files"][0]["scaler"]["scale"] == "inf"
    assert [f["check"] for f in doc["findings"]] == ["nonfinite_optimizer_state"]
    assert doc["diff"] is None
    text = CliRunner().invoke(main, ["inspect", str(path), "--top", "2"])
    assert text.exit_code == 0
    # 26 = 8 model floats (2 Linear x 2, BatchNorm weight, bias, running_mean, running_var)
    #    + 6 parameters x 3 Adam slots (exp_avg, exp_avg_sq, step)
    rows = text.stdout.split("worst first (top 2 of 26):\n")[1].splitlines()[1:3]
    assert rows[0].split()[:2] == ["optimizer", "optimizer[model.3.weight].exp_avg_sq"]  # all 16 values NaN
    assert "nonfinite_optimizer_state" in text.stdout


def test_the_cli_compares_two_checkpoints(tmp_path):
    path_a, model, opt = _trained(tmp_path, "a.pt")
    _train(model, opt, 1)
    path_b = _save(tmp_path / "b.pt", model, opt, 3)
    res = CliRunner().invoke(main, ["inspect", str(path_a), str(path_b), "--json"])
    assert res.exit_code == 0
    diff = json.loads(res.stdout)["diff"]
    assert diff["stalled"] == [] and diff["became_nonfinite"] == [] and len(diff["changes"]) == 26
    text = CliRunner().invoke(main, ["inspect", str(path_a), str(path_b)]).stdout
    assert "changes a.pt -> b.pt (26 tensors compared)" in text


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint", b"PK\x03\x04garbage", b"\x80garbage"])
def test_the_cli_turns_bad_files_into_one_error_line_and_exit_1(tmp_path, content):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content)
    res = CliRunner().invoke(main, ["inspect", str(bad)])
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith("Error: ") and "bad.pt" in line


def test_a_missing_file_is_a_bad_input_error_naming_the_file(tmp_path):
    with pytest.raises(BadInputError, match=r"nope.pt: no such file \(check the path\)"):
        inspect_checkpoints(tmp_path / "nope.pt")


def test_progress_goes_to_stderr_for_large_scans(tmp_path, monkeypatch, capsys):
    path, _, _ = _trained(tmp_path)
    monkeypatch.setattr(insp, "_PROGRESS_MIN_BYTES", 0)  # a tiny file stands in for a large one
    inspect_checkpoints(path, progress=True)
    err = capsys.readouterr().err
    assert err.startswith("\rinspect: ") and err.endswith("GB scanned\n")
    inspect_checkpoints(path, progress=False)
    assert capsys.readouterr().err == ""


def test_render_lists_at_most_top_tensors_per_file(tmp_path):
    path, _, _ = _trained(tmp_path)
    text = render_inspect_text(inspect_checkpoints(path), top=3)
    assert "worst first (top 3 of 26)" in text and "findings: none" in text  # 26: see the CLI test
