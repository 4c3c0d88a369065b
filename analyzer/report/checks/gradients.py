"""Per-layer gradient checks: ``stalled_layers``, ``vanishing_gradients``, ``exploding_gradients``,
``grad_underflow``. They read ``Frames.layer_bins`` (per step bin and layer), never raw rows.

A layer is *stalled* in a bin when its unscaled gradient norm (geometric mean over the bin's
steps; one step per bin for runs up to 2000 steps) is below ``ABS_SMALL``, or more than
``REL_DECADES`` decades below the median layer of that bin.
Depth trends are least-squares fits of log10 gradient norm against module depth (model
order) or against steps, with scipy's p-value; a trend must also be large (``TREND_DECADES``).

Real output (a 10-layer sigmoid MLP, init std 0.02, FP16, 40 steps)::

    stalled_layers @ step 0: 11 of 22 parameters have a gradient below 1e-9 or 10^-4 x the median
    layer on most steps (0.weight, 0.bias, 2.weight, 2.bias, 4.weight, 4.bias and 5 more), 49% of
    parameters at the end; they sit early in the network, with gradient norm growing towards the
    output: the gradient vanishes on its way back through depth ...
    vanishing_gradients: gradient norm shrinks by 10^9.9 from the output back to the input
    (module '20' -> '8'; slope 1.65 decades/module, p=1e-10); 4 module(s) get exactly zero
    gradient (0, 2, 4, 6): the early layers barely learn ...
"""
from __future__ import annotations

import numpy as np
import polars as pl

from ...findings import Finding
from . import _stats as stats
from .frames import LOG_FLOOR, Frames
from .scaler import collapse_start

__all__ = ["stalled_layers", "vanishing_gradients", "exploding_gradients", "grad_underflow",
           "stalled_fraction", "layer_profile", "ABS_SMALL", "REL_DECADES"]

ABS_SMALL = 1e-9       # an unscaled gradient norm this small moves nothing
REL_DECADES = 4.0      # 10,000x below the median layer
MOST = 0.5             # "most steps": more than half of the (binned) steps
NORMAL_DECADES = 3.0   # "other layers normal": the upper-quartile layer is above 1e-6
TREND_DECADES = 3.0    # a depth trend must span 1000x to matter
TREND_P = 0.01
STEP_TREND_DECADES = 2.0
UNDERFLOW_RMS_LOG10 = -2.0  # typical scaled element <= 1e-2: within ~5 decades of FP16's subnormals


def _stalled_bins(frames: Frames) -> pl.DataFrame:
    """Per (bin, layer): stalled, has_grad (computed once per Frames: three checks read it)."""
    return frames.derived("stalled_bins", _build_stalled_bins)


def _build_stalled_bins(frames: Frames) -> pl.DataFrame:
    lb = frames.layer_bins.filter(pl.col("n") > 0)
    med = lb.group_by("bin").agg(med_lg=pl.col("lg").median())
    lb = lb.join(med, on="bin")
    small = pl.col("lg") < np.log10(ABS_SMALL)  # the bin's geometric-mean norm (one step per bin up to 2000 steps)
    rel = pl.col("lg") < pl.col("med_lg") - REL_DECADES
    return lb.with_columns(stalled=(small | rel).fill_null(False),
                           has_grad=pl.col("n_grad") > 0)


def _weights(frames: Frames, layers: np.ndarray) -> np.ndarray:
    """Each row's parameter element count (1 where unknown): one table lookup, not a Python loop per row."""
    table = np.array([n if n else 1 for n in frames.numels], dtype=float)
    layers = np.asarray(layers, dtype=np.int64)
    out = np.ones(layers.shape, dtype=float)
    known = (layers >= 0) & (layers < table.size)
    out[known] = table[layers[known]]
    return out


def stalled_fraction(frames: Frames) -> pl.DataFrame:
    """Per bin: the fraction of parameters (by element count) whose gradient is stalled."""
    sb = _stalled_bins(frames).filter(pl.col("has_grad"))
    sb = sb.with_columns(w=pl.Series(_weights(frames, sb["layer"].to_numpy())))
    return (sb.group_by("bin").agg(step=pl.col("step_lo").min(),
                                   frac=(pl.col("w") * pl.col("stalled")).sum() / pl.col("w").sum())
            .sort("bin"))


def stalled_layers(frames: Frames) -> list[Finding]:
    """Layers stalled on most steps while the median layer is normal; early vs interior."""
    if frames.layer_bins is None:
        return []
    sb = _stalled_bins(frames)
    per = (sb.filter(pl.col("has_grad")).group_by("layer")
           .agg(frac=pl.col("stalled").mean(), lg=pl.col("lg").median(), pnorm=pl.col("pnorm").median())
           .sort("layer"))
    upper = sb.group_by("bin").agg(pl.col("lg").quantile(0.75))["lg"].drop_nulls()  # null: no finite norm in the bin
    if upper.len() == 0 or (upper > np.log10(ABS_SMALL) + NORMAL_DECADES).mean() < MOST:
        return []  # (nearly) every layer is tiny: that is not "stalled while others are normal"
    bad = per.filter(pl.col("frac") > MOST)
    if bad.height == 0 or bad.height == per.height:
        return []
    bad, cancelled = _split_cancelled_biases(frames, per, bad)
    found = [_cancelled_bias_finding(frames, cancelled)] if cancelled else []
    if bad.height == 0:
        return found
    idx = bad["layer"].to_numpy()
    names = [frames.param_name(int(i)) for i in idx]
    frac_t = stalled_fraction(frames)["frac"].to_numpy()
    depth = np.arange(per.height)
    pos = np.searchsorted(per["layer"].to_numpy(), idx)
    early = bool(np.mean(pos < per.height / 2) >= 0.8)
    rho = stats.spearman(depth, per["lg"].fill_null(-30).to_numpy()) if per.height > 2 else 0.0
    gates = per.filter(pl.col("pnorm") < 1e-6)
    if early and rho > 0.5:
        where = ("early in the network, with gradient norm growing towards the output: the gradient "
                 "vanishes on its way back through depth (saturating activations, small init, no "
                 "residual path or normalisation)")
        kind = "early"
    else:
        where = ("between normal layers: typical of a residual branch multiplied by a near-zero "
                 "gate or layer scale, a dead activation, or a detached branch")
        kind = "interior"
    gate_names = [frames.param_name(int(i)) for i in gates["layer"].to_numpy()[:5]]
    if gate_names and kind == "interior":
        where += f" (near-zero parameters: {', '.join(gate_names)})"
    first_bin = sb.filter(pl.col("stalled") & pl.col("layer").is_in(idx.tolist()))
    step = int(first_bin["step_lo"].min()) if first_bin.height else None
    ev = {"layers": names[:20], "n_layers": len(names), "of": per.height, "location": kind,
          "stalled_step_fraction": dict(zip(names[:20], bad["frac"].round(3).to_list()[:20])),
          "median_log10_grad_norm": dict(zip(names[:20], bad["lg"].round(2).to_list()[:20])),
          "param_fraction_stalled": {"first": float(frac_t[0]), "last": float(frac_t[-1]),
                                     "mean": float(frac_t.mean())},
          "depth_rank_correlation": float(rho), "near_zero_params": gate_names,
          "thresholds": {"abs": ABS_SMALL, "rel_decades": REL_DECADES}}
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return found + [Finding("stalled_layers", "warning", step,
                    f"{len(names)} of {per.height} parameters have a gradient below 1e-9 or 10^-4 x the median "
                    f"layer on most steps ({shown}), {frac_t[-1]:.0%} of parameters at the end; they sit {where}",
                    ev)]


def _split_cancelled_biases(frames: Frames, per: pl.DataFrame, bad: pl.DataFrame) -> tuple[pl.DataFrame, list[int]]:
    """Split off stalled ``X.bias`` parameters whose ``X.weight`` is *not* stalled.

    A weight's gradient is its output gradient times its input; the bias's is the output
    gradient summed over the batch. A learning weight beside a near-zero bias therefore means
    the output gradient sums to ~0: whatever follows cancels a constant shift (a BatchNorm or
    LayerNorm right after the layer, or a softmax over key logits, where a key bias adds the
    same value to every logit of a row). That bias is redundant, not a training stall.
    """
    name_to_layer = {frames.param_name(int(i)): int(i) for i in per["layer"].to_numpy()}
    stalled = set(bad["layer"].to_list())
    cancelled = []
    for i in bad["layer"].to_numpy():
        name = frames.param_name(int(i))
        if name.endswith(".bias"):
            weight = name_to_layer.get(name[: -len("bias")] + "weight")
            if weight is not None and weight not in stalled:
                cancelled.append(int(i))
    return bad.filter(~pl.col("layer").is_in(cancelled)), cancelled


def _cancelled_bias_finding(frames: Frames, layers: list[int]) -> Finding:
    names = [frames.param_name(i) for i in layers]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return Finding(
        "stalled_layers", "info", None,
        f"{len(names)} bias(es) get almost no gradient while their layer's weight learns ({shown}): "
        "what follows cancels a constant shift (a BatchNorm/LayerNorm right after the layer, or a "
        "key bias before softmax), so these biases are redundant, not stalled; drop them (bias=False)",
        {"layers": names[:20], "n_layers": len(names), "location": "cancelled_bias"})


def layer_profile(frames: Frames) -> pl.DataFrame:
    """Median log10 grad norm per module (params grouped by name prefix), in model order."""
    per = (frames.layer_bins.filter(pl.col("lg").is_not_null()).group_by("layer")
           .agg(lg=pl.col("lg").median()).sort("layer"))
    mods = [frames.param_name(int(i)).rsplit(".", 1)[0] for i in per["layer"].to_numpy()]
    per = per.with_columns(module=pl.Series(mods, dtype=pl.String), layer_min=pl.col("layer"))
    return (per.group_by("module", maintain_order=True).agg(lg=pl.col("lg").max(), first=pl.col("layer").min())
            .sort("first").with_columns(depth=pl.int_range(pl.len())))


def _depth_trend(frames: Frames) -> dict | None:
    """The fit of log10 gradient norm against module depth (once per Frames: both trend checks read it)."""
    d = frames.derived("depth_trend", _build_depth_trend)
    return None if d is None else dict(d)


def _build_depth_trend(frames: Frames) -> dict | None:
    if frames.layer_bins is None:
        return None
    full = layer_profile(frames)
    # a module whose gradient is exactly zero (log floor) has no slope to fit; list it instead
    prof = full.filter(pl.col("lg") > np.log10(LOG_FLOOR) + 1)
    if prof.height < 4:
        return None
    fit = stats.linregress(prof["depth"].to_numpy(), prof["lg"].to_numpy())
    span = fit.slope * (prof.height - 1)
    return {"zero_gradient_modules": full.filter(pl.col("lg") <= np.log10(LOG_FLOOR) + 1)["module"].to_list(),"slope_decades_per_module": float(fit.slope), "p_value": float(fit.pvalue), "r": float(fit.rvalue),
            "span_decades": float(span), "modules": prof.height, "first": prof["module"][0],
            "last": prof["module"][-1], "profile": dict(zip(prof["module"].to_list()[:40],
                                                             prof["lg"].round(2).to_list()[:40]))}


def _step_trend(frames: Frames) -> dict | None:
    """The fit of log10 total gradient norm against steps (once per Frames: both trend checks read it)."""
    t = frames.derived("step_trend", _build_step_trend)
    return None if t is None else dict(t)


def _build_step_trend(frames: Frames) -> dict | None:
    df = frames.steps.filter(pl.col("grad_norm").is_finite() & (pl.col("grad_norm") > 0)
                             & ~pl.col("skipped").fill_null(False))
    if df.height < 20:
        return None
    nb = min(200, df.height)
    x = df["step"].to_numpy().astype(float)  # sorted: each bin is one contiguous slice
    y = np.log10(df["grad_norm"].to_numpy())
    # each bin's medians, in one group-by (a bin is the x in [edge k-1, edge k); empty bins are absent)
    b = np.searchsorted(np.linspace(x[0], x[-1] + 1, nb + 1)[1:-1], x, side="right")
    med = (pl.DataFrame({"b": b, "x": x, "y": y}).group_by("b").agg(pl.col("x").median(), pl.col("y").median())
           .sort("b"))
    xb, yb = med["x"].to_numpy(), med["y"].to_numpy()
    fit = stats.linregress(xb, yb)
    q = max(1, len(yb) // 4)
    return {"slope_decades_per_1k_steps": float(fit.slope * 1000), "p_value": float(fit.pvalue),
            "change_decades": float(fit.slope * (xb[-1] - xb[0])), "first_quarter_log10": float(np.median(yb[:q])),
            "last_quarter_log10": float(np.median(yb[-q:])), "steps": int(df.height),
            "x": x, "y": y}


def _trend_findings(frames: Frames, sign: int) -> list[Finding]:
    name = "exploding_gradients" if sign > 0 else "vanishing_gradients"
    out = []
    d = _depth_trend(frames)
    # vanishing: norm grows towards the output (early layers starved); exploding: the reverse
    if d and d["p_value"] < TREND_P and -sign * d["span_decades"] >= TREND_DECADES:
        way = "shrinks" if sign < 0 else "grows"
        zero = d["zero_gradient_modules"]
        dead = (f"; {len(zero)} module(s) get exactly zero gradient ({', '.join(map(str, zero[:6]))})"
                if zero else "")
        out.append(Finding(name, "warning", None,
                           f"gradient norm {way} by 10^{abs(d['span_decades']):.1f} from the output back to "
                           f"the input (module {d['last']!r} -> {d['first']!r}; slope "
                           f"{d['slope_decades_per_module']:.2f} decades/module, p={d['p_value']:.1g}){dead}: "
                           + ("the early layers barely learn; use residual connections, normalisation, "
                              "ReLU/GELU instead of saturating activations, or a larger init"
                              if sign < 0 else
                              "the early layers get the largest updates; check init scale and normalisation"), d))
    t = _step_trend(frames)
    if t is not None:
        x, y = t.pop("x"), t.pop("y")
        moved = sign * (t["last_quarter_log10"] - t["first_quarter_log10"])
        if t["p_value"] < 1e-3 and sign * t["change_decades"] >= STEP_TREND_DECADES and moved >= STEP_TREND_DECADES:
            thr = t["first_quarter_log10"] + sign * 1.0
            hit = np.flatnonzero(sign * (y - thr) > 0)
            step = int(x[hit[0]]) if hit.size else None
            way = "rose" if sign > 0 else "fell"
            out.append(Finding(name, "warning", step,
                               f"the total gradient norm {way} by 10^{abs(t['change_decades']):.1f} over the run "
                               f"({t['slope_decades_per_1k_steps']:+.2f} decades per 1000 steps, p={t['p_value']:.1g})"
                               + ("; lower the learning rate or clip gradients" if sign > 0 else
                                  "; the model stopped learning (dead units, collapsed activations)"), t))
    return out


def vanishing_gradients(frames: Frames) -> list[Finding]:
    """log grad norm rises towards the output (through depth) or falls over steps, significantly."""
    return _trend_findings(frames, -1)


def exploding_gradients(frames: Frames) -> list[Finding]:
    """log grad norm rises towards the input (through depth) or over steps, significantly."""
    return _trend_findings(frames, +1)


def _scaled_rms(frames: Frames, lb: pl.DataFrame, tail: set) -> dict[int, float]:
    """log10 of each layer's typical scaled gradient element (norm / sqrt(numel) x scale) at the end."""
    s = frames.steps
    s0 = int(s["step"].min())
    scale = (s.with_columns(bin=((pl.col("step") - s0) // frames.bin_width).cast(pl.Int32))
             .group_by("bin").agg(ls=pl.col("scale").filter(pl.col("scale") > 0).log10().median()))
    t = lb.filter(pl.col("bin").is_in(tail)).join(scale, on="bin", how="left")
    t = t.with_columns(w=pl.Series(np.log10(_weights(frames, t["layer"].to_numpy()))))
    t = t.with_columns(r=pl.col("lg") - 0.5 * pl.col("w") + pl.col("ls").fill_null(0.0))
    return dict(zip(*t.group_by("layer").agg(pl.col("r").median()).sort("layer").get_columns()))


def grad_underflow(frames: Frames) -> list[Finding]:
    """FP16 runs: the fraction of exactly-zero gradient elements rises (or stays high)."""
    if frames.amp_dtype != "float16" or frames.layer_bins is None:
        return []
    lb = frames.layer_bins.filter(pl.col("zero_frac").is_not_null())
    bad = frames.steps.filter(pl.col("loss").is_not_null() & ~pl.col("loss").is_finite())["step"]
    stops = [s for s in (collapse_start(frames), bad.min() if bad.len() else None) if s is not None]
    if stops:  # after a NaN or a collapsing scale everything underflows: those checks say it first
        lb = lb.filter(pl.col("step_hi") < min(stops))
    bins = lb["bin"].unique().sort().to_numpy()
    if bins.size < 5:
        return []
    k = max(1, bins.size // 10)
    head, tail = set(bins[:k].tolist()), set(bins[-k:].tolist())
    rms = _scaled_rms(frames, lb, set(bins[-k:].tolist()))
    rising, dead = [], []
    # the first and last tenth's mean zero fraction of every layer in one aggregate; the trend fit
    # only for the layers whose fraction rose by 0.2 or more
    ends = lb.group_by("layer").agg(z0=pl.col("zero_frac").filter(pl.col("bin").is_in(list(head))).mean(),
                                    z1=pl.col("zero_frac").filter(pl.col("bin").is_in(list(tail))).mean())
    for layer, z0, z1 in ends.filter(pl.col("z1") - pl.col("z0") >= 0.2).iter_rows():
        g = lb.filter(pl.col("layer") == layer)
        fit = stats.linregress(g["bin"].to_numpy(), g["zero_frac"].to_numpy())
        if fit.pvalue < TREND_P and fit.slope > 0:
            # exact zeros from underflow need scaled elements near FP16's subnormals (6e-8);
            # zeros in a layer whose typical scaled element is ~1 are dead units (ReLU), not underflow
            (rising if rms.get(int(layer), 0.0) <= UNDERFLOW_RMS_LOG10 else dead).append((int(layer), float(z0), float(z1)))
    w = lb.with_columns(w=pl.Series(_weights(frames, lb["layer"].to_numpy())))
    overall = (w.group_by("bin").agg(z=(pl.col("w") * pl.col("zero_frac")).sum() / pl.col("w").sum())
               .sort("bin"))["z"].to_numpy()
    ev = {"overall_zero_fraction": {"first": float(overall[:k].mean()), "last": float(overall[-k:].mean())}}
    if rising:
        rising.sort()
        ev["layers"] = {frames.param_name(i): {"first": a, "last": b} for i, a, b in rising[:20]}
        step = int(lb.filter(pl.col("bin") == bins[k])["step_lo"].min())
        names = ", ".join(frames.param_name(i) for i, _, _ in rising[:5])
        return [Finding("grad_underflow", "warning", step,
                        f"the fraction of exactly-zero gradient elements rose in {len(rising)} parameter(s) "
                        f"({names}): small FP16 gradients flush to zero; keep a GradScaler (and let its scale "
                        "grow), or use BF16", ev)]
    if dead:
        names = ", ".join(frames.param_name(i) for i, _, _ in sorted(dead)[:5])
        ev["dead_unit_layers"] = {frames.param_name(i): {"first": a, "last": b, "log10_scaled_rms": rms.get(i)}
                                  for i, a, b in sorted(dead)[:20]}
        return [Finding("grad_underflow", "info", None,
                        f"the fraction of exactly-zero gradient elements rose in {len(dead)} parameter(s) ({names}), "
                        "but their scaled gradients are far above FP16's smallest values: dead units "
                        "(e.g. ReLUs that stopped firing), not underflow", ev)]
    if overall[-k:].mean() >= 0.5:
        return [Finding("grad_underflow", "info", None,
                        f"{overall[-k:].mean():.0%} of gradient elements are exactly zero at the end of the run "
                        "(steady, so likely sparse by design: embeddings, ReLU); FP16 underflow would make it rise",
                        ev)]
    return []
