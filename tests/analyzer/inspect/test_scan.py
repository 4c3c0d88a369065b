"""The one torch scan behind ``analyzer inspect``, against what real ``.half()``/``.bfloat16()`` casts do."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzer.inspect._scan import Scanner, _count_le, scanned_numel

from .inspect_values import STAT_FIELDS, edge_values, expected

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]


def _got(s) -> dict:
    return {k: getattr(s, k) for k in STAT_FIELDS}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [1000, 1 << 18])  # many chunks with a ragged tail, and one chunk
@pytest.mark.parametrize("signs", ["mixed", "non-negative"])
def test_every_count_equals_what_real_fp16_and_bf16_casts_do_at_every_boundary(dtype, chunk, signs):
    x = edge_values() if signs == "mixed" else edge_values().abs()
    x = x.to(dtype)
    s = Scanner(chunk=chunk).tensor(x)
    assert s.numel == x.numel() and _got(s) == expected(x)
    if dtype == torch.float32:  # the edge values exercise every count
        assert (s.nan, s.inf, s.zeros) == (1, 2, 5)
        assert s.fp16_flush > 0 and s.fp16_overflow > 0 and s.bf16_flush > 0 and s.bf16_overflow > 0


@pytest.mark.parametrize("scale", [2.0**-26, 2.0**-135])  # all below FP16's flush point; also below BF16's
def test_chunks_whose_every_nonzero_value_flushes_are_counted_exactly(scale):
    x = torch.rand(5000, generator=torch.Generator().manual_seed(1)) * scale
    x[::7] = 0.0
    s = Scanner(chunk=1000).tensor(x)
    assert _got(s) == expected(x)
    assert s.fp16_flush == int((x != 0).sum())  # every non-zero value


_ODD = {  # one value planted in healthy weights, |x| in [0.5, 1.5)
    "none": None, "inf": float("inf"), "nan": float("nan"),
    "above 65520": 65520.0,               # the smallest float32 that becomes inf in FP16
    "just below 65520": 65519.996,        # rounds down to 65504
    "at 2**-25": 2.0**-25,                # flushes (ties to even)
    "just above 2**-25": 2.0**-25 * (1 + 2.0**-23),  # survives as the smallest FP16 subnormal
    "bf16 subnormal": 1e-40, "zero": 0.0, "negative zero": -0.0,
}


@pytest.mark.parametrize("odd", list(_ODD))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_odd_value_in_healthy_weights_is_counted_exactly(odd, dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(1 << 18, generator=g) + 0.5) * torch.where(torch.rand(1 << 18, generator=g) < 0.5, -1.0, 1.0)
    x = x.to(dtype)
    if _ODD[odd] is not None:
        x[170_001] = _ODD[odd]  # in the 6th of 8 chunks (bf16/fp16: rounded or flushed by the cast)
    assert _got(Scanner(chunk=1 << 15).tensor(x)) == expected(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_counts_stay_exact_across_chunks_that_switch_between_counting_and_not(dtype):
    # chunk 1 healthy, 2 and 3 flushing (3 with zeros), 4 healthy again, 5 flushing, 6 NaN among flushing
    n = 4096
    x = (torch.rand(6 * n) + 0.5) * torch.where(torch.rand(6 * n) < 0.5, -1.0, 1.0)
    x[n:2 * n:7] = 1e-9
    x[2 * n:3 * n:5] = -3e-8
    x[2 * n:3 * n:11] = 0.0
    x[2 * n + 500] = -1e-41
    x[2 * n + 600], x[2 * n + 601] = 2.0**-25, -(2.0**-25) * (1 + 2.0**-23)
    x[4 * n + 9] = 2.0**-25
    x[5 * n:6 * n:3] = 1e-8
    x[5 * n + 1], x[5 * n + 2] = float("nan"), -float("inf")
    x = x.to(dtype)
    assert _got(Scanner(chunk=n).tensor(x)) == expected(x)


@pytest.mark.parametrize("dtype, finite", [(torch.float16, 0x7C00), (torch.bfloat16, 0x7F80)])
def test_all_finite_16_bit_magnitudes_of_both_signs_are_counted_exactly(dtype, finite):
    mags = torch.arange(0, finite, dtype=torch.int32)
    bits = torch.cat([mags, mags | 0x8000, torch.tensor([finite, finite + 1, finite | 0x8000])])  # inf, NaN, -inf
    x = bits.to(torch.int16).view(dtype)
    assert _got(Scanner(chunk=4099).tensor(x)) == expected(x)


def test_each_float16_magnitude_alone_reads_back_exactly():
    # every subnormal and every 29th normal magnitude, each scanned as a tensor of its own
    bits = torch.cat([torch.arange(0, 0x400), torch.arange(0x400, 0x7C00, 29)]).to(torch.int16)
    scanner = Scanner(chunk=1)
    for v in bits.view(torch.float16):
        s, want = scanner.tensor(v.reshape(1)), v.item()
        assert (s.abs_max, s.min_nonzero) == (want, want or None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment", ["exp_avg", "exp_avg_sq"])
def test_adam_moments_that_flush_in_every_chunk_are_counted_exactly(dtype, moment):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5 * 8192 + 13, generator=g) * 1e-7  # about a quarter of |x| <= 2**-25
    x = (x.square().add_(2.0**-40) if moment == "exp_avg_sq" else x).to(dtype)
    s = Scanner(chunk=8192).tensor(x)
    assert _got(s) == expected(x)
    assert 0 < s.fp16_flush and (s.fp16_flush == x.numel()) == (moment == "exp_avg_sq")


_KINDS = {  # what one chunk holds besides values |x| in [0.5, 1.5)
    "healthy": [], "few flush": [2.0**-25, -1e-9, 3e-30], "all flush": None, "zero": [0.0],
    "nan": [float("nan")], "overflow": [7e4], "bf16 flush": [-1e-41], "flush and zero": [1e-9, -0.0],
}


@settings(max_examples=80, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(_KINDS)), min_size=1, max_size=14), chunk=st.integers(4, 40),
       tail=st.integers(0, 3), nonneg_first=st.booleans(), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_runs_of_chunks_of_every_kind_in_any_order_give_what_real_casts_give(kinds, chunk, tail, nonneg_first,
                                                                              seed, dtype):
    # every path of Scanner._fold in any order: a chunk's kind decides whether it is counted, and the
    # totals carry across chunks; a ragged tail; with and without a non-negative first chunk (the scan
    # reads non-negative tensors without clearing sign bits until it meets one)
    g = torch.Generator().manual_seed(seed)
    parts = []
    for i, kind in enumerate(kinds):
        x = torch.rand(chunk, generator=g) + 0.5
        if not (nonneg_first and i == 0):
            x *= torch.where(torch.rand(chunk, generator=g) < 0.5, -1.0, 1.0)
        odd = _KINDS[kind]
        if odd is None:
            x *= 2.0**-26
        else:
            pos = torch.randperm(chunk, generator=g)[:len(odd)]
            x[pos] = torch.tensor(odd[:len(pos)])
        parts.append(x)
    x = torch.cat(parts + [torch.rand(tail, generator=g) + 0.5]).to(dtype)
    assert _got(Scanner(chunk=chunk).tensor(x)) == expected(x)


_F32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
_SPECIAL = st.sampled_from([0.0, -0.0, 65504.0, 65520.0, -65519.996, 2.0**-25, -(2.0**-24), 2.0**-134, 1e-45,
                            3.4e38, float("nan"), -float("inf")])


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(_F32, _SPECIAL), max_size=300), dtype=st.sampled_from(DTYPES),
       chunk=st.integers(1, 64))
def test_any_values_in_any_dtype_and_chunking_give_what_real_casts_give(values, dtype, chunk):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    s = Scanner(chunk=chunk).tensor(x)
    assert s.numel == len(values) and _got(s) == expected(x)


def _signed(u: int, width: int) -> int:
    return u - (1 << width) if u >> (width - 1) else u


# NaNs of both signs, quiet and signalling, with the least and the greatest payloads; then -inf, -0.0 and
# the most negative finite value, which abs must also map to their magnitudes
_NAN_BITS = {
    torch.float32: (torch.int32, [_signed(u, 32) for u in (
        0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800000, 0x80000000,
        0xFF7FFFFF)]),
    torch.float64: (torch.int64, [_signed(u, 64) for u in (
        0xFFF0000000000001, 0xFFF8000000000000, 0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001, 0x7FF8000000000000,
        0x7FFFFFFFFFFFFFFF, 0xFFF0000000000000, 0x8000000000000000, 0xFFEFFFFFFFFFFFFF)]),
}
_NANS = 6  # the first six of each list

_ABS_RUN = """
import json, sys, torch
out = []
for dtype, ints, pats in json.loads(sys.argv[1]):
    dtype, ints = getattr(torch, dtype), getattr(torch, ints)
    for n in (1, 7, 16, 37, 1000):  # vector bodies and scalar tails
        bits = torch.tensor(pats, dtype=ints).repeat(n)
        out.append(int(torch.abs(bits.view(dtype)).view(ints).min()) >= 0)
print(json.dumps([torch.backends.cpu.get_cpu_capability(), out]))
"""


def _run_on_kernels(cap: str | None, code: str, *args: str):
    """`code`'s JSON output, run in a fresh interpreter on ATen's `cap` kernels (None: the native ones)."""
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if cap:
        env["ATEN_CPU_CAPABILITY"] = cap
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


@pytest.mark.parametrize("cap", ["default", None])
def test_torch_abs_clears_the_sign_bit_of_nans_infs_and_zeros_on_native_and_portable_kernels(cap):
    # the scan clears float32/float64 signs with torch.abs and reads the result as magnitude bits
    pats = [[str(d).removeprefix("torch."), str(i).removeprefix("torch."), p] for d, (i, p) in _NAN_BITS.items()]
    capability, ok = _run_on_kernels(cap, _ABS_RUN, json.dumps(pats))
    assert all(ok), capability


@pytest.mark.parametrize("dtype", list(_NAN_BITS))
def test_nans_of_either_sign_and_any_payload_are_counted_as_nan_among_healthy_values(dtype):
    ints, pats = _NAN_BITS[dtype]
    healthy = torch.linspace(-1.0, 1.0, 4000, dtype=torch.float64).add_(1e-3).to(dtype)
    x = torch.cat([healthy, torch.tensor(pats, dtype=ints).view(dtype)])
    for chunk in (64, 1 << 18):
        s = Scanner(chunk=chunk).tensor(x)
        assert _got(s) == expected(x) and s.nan == _NANS and s.inf == 1 and s.zeros == 1


def test_the_scan_never_writes_to_the_tensor_it_reads():
    x = edge_values()
    before = x.clone()
    Scanner(chunk=100).tensor(x)
    Scanner(chunk=100).pair(x, x.flip(0))
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # bits, NaN and -0.0 included


# --- layouts ---------------------------------------------------------------------------------

def test_transposed_and_sliced_views_give_the_statistics_of_their_values():
    x = edge_values()[:20_000].view(200, 100)
    for view in (x.t(), x[:, ::3], x[::2, 10:90].t(), x.t()[5]):
        assert _got(Scanner(chunk=512).tensor(view)) == expected(view.contiguous()), view.stride()


def test_an_expanded_view_is_scanned_through_its_distinct_values_without_materialising_them():
    base = torch.tensor([1e-9, 7e4, float("nan")])
    huge = base.expand(1_000_000_000, 3)  # 3e9 declared elements in a 12-byte storage
    s = Scanner().tensor(huge)
    assert scanned_numel(huge) == s.numel == 3
    assert _got(s) == expected(base)
    overlapping = torch.arange(2000.0).as_strided((1000, 1000), (1, 1))  # stride 1 in both dims: overlaps
    assert Scanner().tensor(overlapping).numel == scanned_numel(overlapping) == 1999


# --- pairs -----------------------------------------------------------------------------------

def test_a_pair_gives_each_side_its_single_scan_and_counts_changes_like_float_compares():
    a = edge_values()
    b = a.clone()
    b[:5000] *= 3.0
    b[7] = float("nan")
    a[200], b[200] = 0.0, -0.0  # equal as floats: not a change
    sa, sb, change = Scanner(chunk=1000).pair(a, b)
    assert (sa, sb) == (Scanner(chunk=1000).tensor(a), Scanner(chunk=1000).tensor(b))
    assert change.changed == int((a != b).sum())  # NaN != NaN: both NaN positions count
    assert change.rel_change is None  # B holds NaN


@pytest.mark.parametrize("dtype_b", [torch.float32, torch.bfloat16, torch.float64])
def test_the_relative_change_is_the_float64_l2_ratio(dtype_b):
    g = torch.Generator().manual_seed(9)
    a = torch.randn(30_011, generator=g) * 1e3
    b = (a + torch.randn(a.shape, generator=g)).to(dtype_b)
    a64, b64 = a.double(), b.double()
    want = ((b64 - a64).square().sum().sqrt() / a64.square().sum().sqrt()).item()
    _, _, c = Scanner(chunk=4096).pair(a, b)
    assert c.rel_change == pytest.approx(want, rel=1e-12) and c.changed == int((a64 != b64).sum())


_PAIR_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float64]


@settings(max_examples=150, deadline=None)
@given(da=st.sampled_from(_PAIR_DTYPES), db=st.sampled_from(_PAIR_DTYPES), data=st.data())
def test_a_pair_counts_changes_and_sums_like_float64_compares_at_every_bit_pattern_and_step(da, db, data):
    # any bit patterns: subnormals (whose differences square to exactly _ONE), +-0, NaN and inf, equal runs
    # floats() draws +-0, subnormals, NaN, inf and huge values; B keeps each value, moves it to the next
    # float up (at 0 in float32: 2**-149, whose difference squares to exactly _ONE), or takes another
    n = data.draw(st.integers(1, 700))
    junk = data.draw(st.booleans())  # NaN and inf, or none (then every step counts by clamped squares)
    top = None if junk else min(torch.finfo(da).max, torch.finfo(db).max)  # nothing rounds up to inf
    floats = st.floats(min_value=top and -top, max_value=top, allow_nan=junk, allow_infinity=junk)
    a = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64).to(da)
    how = torch.tensor(data.draw(st.lists(st.sampled_from([0, 1, 2]), min_size=n, max_size=n)))
    other = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float64)
    up = torch.nextafter(a.double(), torch.tensor(math.inf)) if da == torch.float64 else \
        torch.nextafter(a.float(), torch.tensor(math.inf)).to(da).double()
    b = torch.where(how == 0, a.double(), torch.where(how == 1, up, other)).to(db)
    chunk = data.draw(st.sampled_from([64, 100, 1 << 18]))  # whole rows, a ragged row, one chunk
    _, _, c = Scanner(chunk=chunk).pair(a, b)
    a64, b64 = a.double(), b.double()
    assert c.changed == int((a64 != b64).sum())
    aa, dd = a64.square().sum().item(), (b64 - a64).square().sum().item()
    if torch.isfinite(a64).all() and torch.isfinite(b64).all() and aa > 0 and math.isfinite(aa + dd):
        assert c.rel_change == pytest.approx(math.sqrt(dd) / math.sqrt(aa), rel=1e-12)
    else:
        assert c.rel_change is None


def test_the_relative_change_of_huge_values_whose_float32_squares_overflow_is_finite():
    a = torch.randn(10_000) * 1e30  # squares near 1e60: inf in float32, fine in float64
    assert Scanner(chunk=1000).pair(a, a * 1.5)[2].rel_change == pytest.approx(0.5, rel=1e-6)


def test_a_pair_in_different_memory_layouts_is_compared_index_by_index():
    x = torch.randn(300, 70)
    y = x.clone()
    y[5, 7] += 1.0
    _, _, c = Scanner(chunk=512).pair(x.t().contiguous().t(), y)  # A column-major, B row-major
    assert c.changed == 1 and c.rel_change == pytest.approx(1.0 / x.norm().item(), rel=1e-5)


def test_pairs_expanded_alike_compare_distinct_values_and_others_are_not_paired():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0])
    _, _, c = Scanner().pair(a.expand(10**9, 2), b.expand(10**9, 2))
    assert (c.changed, c.numel) == (1, 2)
    assert Scanner().pair(a.expand(10**9, 2), torch.ones(10**9, 1).expand(10**9, 2)) is None  # broadcast differently


_INTS = [torch.int8, torch.int16, torch.int32, torch.int64]


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(_INTS), data=st.data())
def test_count_le_equals_a_compare_and_sum_when_the_clamped_sum_wraps_and_when_it_runs_in_place(dtype, data):
    top = torch.iinfo(dtype).max
    vals = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=60))
    limit = data.draw(st.one_of(st.sampled_from(vals), st.integers(-2, top), st.sampled_from([0, top - 1, top])))
    reps = data.draw(st.sampled_from([1, 3, 70_001]))  # 70,001 copies: k * limit passes 2**32 many times
    x = torch.tensor(vals, dtype=dtype).repeat(reps)
    want = int((x <= limit).sum())
    assert _count_le(x, limit, torch.empty_like(x)) == want
    y = x.clone()
    assert _count_le(y, limit, y) == want


# --- determinism and devices -----------------------------------------------------------------

_RUN = """
import json, torch
from analyzer.inspect._scan import Scanner
# inputs from correctly rounded ops only (randn's kernels differ by SIMD width themselves)
i = torch.arange(1_000_003, dtype=torch.float64)
a = ((i * 0.7548776662466927 % 1.0 - 0.5) * 1e3).float()
b = a + ((i * 0.5698402909980532 % 1.0 - 0.5) * 1e-2).float()
sa, sb, c = Scanner().pair(a, b)
tiny = (a * 2.0**-40).abs()  # Adam-like moments: ~half flush in FP16, so every chunk is counted
print(json.dumps([torch.backends.cpu.get_cpu_capability(), int(b.view(torch.int32).long().sum()),
                  [repr(v) for v in Scanner().tensor(tiny).__dict__.values()],
                  [repr(v) for v in Scanner().tensor(a * 2.0**-40).__dict__.values()],
                  repr(c.rel_change), c.changed,
                  [repr(v) for v in sa.__dict__.values()], [repr(v) for v in Scanner().tensor(b.bfloat16()).__dict__.values()]]))
"""


def test_results_are_bit_identical_whatever_simd_the_cpu_kernels_use():
    (cap0, *rest0), (cap1, *rest1) = (_run_on_kernels(cap, _RUN) for cap in ("default", None))
    if cap0 == cap1:
        pytest.skip(f"this CPU has no SIMD beyond {cap0!r} to compare against")
    assert rest0 == rest1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_scan_on_the_gpu_gives_what_the_cpu_scan_gives():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = edge_values().to(dtype)
        assert Scanner("cuda", chunk=4096).tensor(x) == Scanner(chunk=4096).tensor(x)
    a = edge_values().nan_to_num()
    b = a * 1.001
    ga, gb, gc = Scanner("cuda").pair(a, b)
    ca, cb, cc = Scanner().pair(a, b)
    assert (ga, gb, gc.changed) == (ca, cb, cc.changed) and math.isclose(gc.rel_change, cc.rel_change, rel_tol=1e-12)


def test_progress_is_reported_in_bytes_read_in_chunks_of_the_same_bytes_for_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        seen = []
        Scanner(chunk=3000).tensor(torch.randn(7_500).to(dtype), seen.append)  # chunk: 3000 float32s = 12000 bytes
        size = 7_500 * dtype.itemsize
        assert seen == [12000] * (size // 12000) + ([size % 12000] if size % 12000 else []), dtype


def test_tensors_scanned_side_by_side_on_threads_give_what_one_thread_gives_and_torch_threads_come_back():
    from analyzer.inspect._scan import scan_all

    g = torch.Generator().manual_seed(11)
    ts = [torch.randn(n, generator=g) * 10.0 ** e for n, e in [(5000, 0), (30_000, -9), (7, 4), (0, 0), (64_000, 6)]]
    ts[1][3] = float("nan")
    items = [(t, None) for t in ts] + [(edge_values(), edge_values().flip(0)), (ts[0].bfloat16(), ts[0])]
    before = torch.get_num_threads()
    seen = []
    one = scan_all(items, threads=1)
    many = scan_all(items, threads=3, on_bytes=seen.append)
    assert torch.get_num_threads() == before
    assert many == one and many[0][0] == Scanner().tensor(ts[0]) and many[-1][2] == Scanner().pair(ts[0].bfloat16(), ts[0])[2]
    assert sum(seen) == sum(a.nbytes + (0 if b is None else b.nbytes) for a, b in items)


def test_a_large_tensor_cut_between_threads_gives_the_statistics_of_one_scan(monkeypatch):
    from analyzer.inspect import _scan

    monkeypatch.setattr(_scan, "SPLIT_AT", 1000)  # edge_values' 20,029 values: cut in 3 parts
    x = edge_values().view(-1, 1).expand(-1, 2).t()  # a broadcast, transposed view: parts of its distinct values
    assert len(_scan._parts(x, 3)) == 3
    for t in (edge_values(), x, edge_values().bfloat16()):
        assert _scan.scan_all([(t, None)], threads=3)[0] == (Scanner().tensor(t), None, None)
