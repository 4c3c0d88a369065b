"""Update checks: ``nonfinite_weights`` (the optimizer step broke the weights) and ``stalled_updates``
(the optimizer step stopped changing them). Both are failures born in the update, where the
gradients look fine.

- ``nonfinite_weights`` (error): the layer trace's ``param_norm`` is taken *before* each step, so a
  NaN/Inf ``param_norm`` at step N+1 after finite gradients at step N means the update of step N
  broke the weights. An ``update`` snapshot (``Recorder(check_update=True)``) pins the step
  directly. The finding is dated at the update's step, so it sorts before the ``nonfinite_loss`` of
  the next step; it names the parameters, the likely causes for the run's optimizer and parameter
  dtypes (computed: ``torch.tensor(eps, dtype=...) == 0``), and the snapshot to replay.
- ``stalled_updates`` (warning): parameters whose gradients are normal and whose lr is > 0, yet
  whose weights stop changing (``unchanged_frac`` >= ``UNCHANGED``, since format 3) on most recorded
  rows, at least ``MIN_ROWS`` of them: updates below half an ulp of the weight round away (BF16
  weights near 1 lose any update below ~0.002). Runs of format < 3 lack the columns; there a
  ``param_norm`` bitwise equal from row to row is the signature. Parameters with zero or absent
  gradients are ``stalled_layers``' business, not this check's.

Real output (``tests/update_runs.py``: a pure-FP16 embedding regressor, Adam at its default eps,
the embedding unfrozen at step 3 while rows 8-15 are never used; then a pure-BF16 MLP at lr 1e-3)::

    nonfinite_weights @ step 3: the weights of 1 parameter(s) became NaN/Inf in the optimizer update of
    step 3 (emb.weight), whose gradients were all finite (loss 93.66): the optimizer update produced the
    NaN/Inf, not the forward or the backward (param_norm, taken before each step, was finite before and
    NaN/Inf at step 4; the update of step 3 did it); likely cause: Adam's eps 1e-08 is 0 in float16 (its
    state's dtype): an element whose gradient has been exactly 0 (unused embedding rows, dead ReLU units)
    gets 0/(sqrt(0)+0) = NaN ...; replay the update snapshot to see which factor went NaN/Inf: analyzer
    replay run/snapshots/step00000003-r00000-update.pt
    nonfinite_loss @ step 4: the loss became nan at step 4 ...

    stalled_updates @ step 1: 1 parameter(s) stopped changing while their gradients are normal and lr > 0:
    2.weight (bfloat16: unchanged on 39 of 39 recorded rows; typical update ~0.001 (about lr for Adam) vs
    half an ulp 0.0039 of its typical magnitude 1); at least 90% of the sampled elements kept their bits
    (unchanged_frac): their updates are smaller than half an ulp of the weights and round away; fixes: ...

How to read it: the step is the update's; the next step's ``nonfinite_loss`` is its consequence. In
``stalled_updates`` the typical update (about lr for Adam, lr x gradient RMS otherwise) is set against
half an ulp of the parameter's typical magnitude (param_norm / sqrt(numel)) in its dtype.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import polars as pl

from recorders import schema

from ...findings import Finding
from ...load import SnapshotInfo
from .frames import Frames
from .gradients import ABS_SMALL, _stalled_bins
from .loss import snapshot_for

__all__ = ["nonfinite_weights", "stalled_updates", "half_ulp", "UNCHANGED", "MIN_ROWS"]

UNCHANGED = 0.9   # a row where >= 90% of the sampled elements kept their bits is a row that did not move
MIN_ROWS = 10     # "many steps": at least this many recorded rows (or bins) without change
MOST = 0.5        # ... and more than half of the parameter's eligible rows
_MANTISSA = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
_TINY = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -126, "float32": 2.0 ** -126, "float64": 2.0 ** -1022}
_FIXES = ("keep FP32 master weights (FP32 parameters under torch.autocast, the AMP way), raise the lr of "
          "those layers, or use stochastic rounding / Kahan-compensated updates for low-precision weights")


def half_ulp(magnitude: float, dtype: str | None) -> float | None:
    """Half the spacing of `dtype` at `magnitude`: a smaller update to a weight this size rounds away."""
    bits = _MANTISSA.get(dtype or "")
    if bits is None or not (isinstance(magnitude, float) and math.isfinite(magnitude) and magnitude > 0):
        return None
    e = max(math.floor(math.log2(magnitude)), math.log2(_TINY[dtype]))
    return 2.0 ** (e - bits - 1)


# -- what meta.json says about the optimizer and the parameters ------------------------------------
def _param_dtype(frames: Frames, layer: int) -> str | None:
    params = frames.meta.get("params")
    p = params[layer] if isinstance(params, list) and 0 <= layer < len(params) else None
    d = p.get("dtype") if isinstance(p, dict) else None
    return d if isinstance(d, str) and d in _MANTISSA else None


def _optimizer(frames: Frames) -> tuple[str | None, list[dict]]:
    opt = frames.meta.get("optimizer")
    if not isinstance(opt, dict):
        return None, []
    cls = opt.get("class")
    groups = [g for g in opt.get("param_groups") or [] if isinstance(g, dict)] \
        if isinstance(opt.get("param_groups"), list) else []
    return (cls.rsplit(".", 1)[-1] if isinstance(cls, str) and cls else None), groups


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _group_of(groups: list[dict], layer: int) -> dict | None:
    for g in groups:
        if isinstance(g.get("params"), list) and layer in g["params"]:
            return g
    return None


def _eps_zero(eps: float, dtype: str) -> bool:
    import torch  # only when a run recorded its optimizer: the report needs no torch otherwise

    return bool(torch.tensor(eps, dtype=getattr(torch, dtype)) == 0)


def _causes(frames: Frames, layers: list[int]) -> list[str]:
    cls, groups = _optimizer(frames)
    if not layers:  # known from an update snapshot only: every parameter the optimizer steps
        layers = sorted({i for g in groups for i in g.get("params") or [] if isinstance(i, int)})
    dtypes = sorted({d for i in layers if (d := _param_dtype(frames, i))})
    out: list[str] = []
    adam = cls is not None and "adam" in cls.lower()
    for i in layers:
        g, d = _group_of(groups, i), _param_dtype(frames, i)
        eps = _num(g.get("eps")) if g else None
        if g is None or d is None or eps is None:
            continue
        if _eps_zero(eps, d):
            text = (f"{cls or 'the optimizer'}'s eps {eps:g} is 0 in {d} (its state's dtype): an element whose "
                    "gradient has been exactly 0 (unused embedding rows, dead ReLU units) gets 0/(sqrt(0)+0) = NaN "
                    f"and a tiny gradient an infinite update; set eps >= {_TINY[d]:.2g} or keep FP32 master weights")
        elif abs(eps) < _TINY[d]:
            text = (f"{cls or 'the optimizer'}'s eps {eps:g} is below {d}'s smallest normal {_TINY[d]:.2g}: "
                    "updates of elements with tiny gradients can overflow")
        else:
            continue
        if text not in out:
            out.append(text)
    low = [d for d in dtypes if d in ("float16", "bfloat16")]
    if low:
        out.append(f"an update larger than {low[0]}'s range (a large lr on {low[0]} weights)")
    if any(_num((_group_of(groups, i) or {}).get("weight_decay")) for i in layers):
        out.append("weight decay applied to a weight that was already Inf")
    if cls is None:
        out.append("the run did not record its optimizer (pass optimizer= to the Recorder to have it named)"
                   + ("; if it is Adam at the default eps=1e-8, that eps is 0 in float16" if "float16" in dtypes
                      else ""))
    elif not adam and not out:
        out.append(f"an update of {cls} past the weights' range")
    return out


# -- nonfinite_weights --------------------------------------------------------------------------
def _first_bad_weights(frames: Frames) -> tuple[int, list[int]] | None:
    """The first step with a NaN/Inf param_norm and the layers that have one there."""
    lb = frames.layer_bins
    if lb is None or frames.layer_rows is None or "pbad" not in lb.columns:
        return None
    hit = lb.filter(pl.col("pbad") > 0)
    if hit.height == 0:
        return None
    first = hit.sort("bin").row(0, named=True)
    rows = frames.layer_rows(int(first["step_lo"]), int(first["step_hi"]))
    pn = pl.col("param_norm")
    bad = rows.filter(pn.is_not_null() & ~pn.is_finite())
    if bad.height == 0:
        return None
    s = int(bad["step"].min())
    return s, sorted({int(i) for i in bad.filter(pl.col("step") == s)["layer"].to_list()})


def _layer_every(frames: Frames) -> int:
    le = frames.meta.get("layer_every")
    return le if isinstance(le, int) and not isinstance(le, bool) and le >= 1 else 1


def _update_snapshot(frames: Frames, lo: int | None, hi: int | None) -> SnapshotInfo | None:
    snaps = [s for s in frames.snapshots if s.reason == schema.UPDATE and s.step is not None
             and (frames.rank is None or s.rank == frames.rank)
             and (lo is None or lo <= s.step) and (hi is None or s.step <= hi)]
    return min(snaps, key=lambda s: (s.step, s.rank or 0)) if snaps else None


def nonfinite_weights(frames: Frames) -> list[Finding]:
    """Weights that became NaN/Inf in an optimizer update whose gradients were all finite."""
    found = _first_bad_weights(frames)
    upd_snap = None
    if found is None:
        upd_snap = _update_snapshot(frames, None, None)
        if upd_snap is None:
            return []
        s, layers, window = upd_snap["step"] + 1, [], frames.steps.filter(pl.col("step") == upd_snap["step"])
        prev = upd_snap["step"]
    else:
        s, layers = found
        prev = s - _layer_every(frames)
        window = frames.steps.filter(pl.col("step").is_between(prev, s - 1))
        upd_snap = _update_snapshot(frames, prev, s - 1)
    if window.height == 0:
        return []  # NaN weights from the first recorded step on: a broken init or checkpoint, not an update
    gn = pl.col("grad_norm")
    bad_grads = window.filter((pl.col("nonfinite_grads").fill_null(0) > 0) | (gn.is_not_null() & ~gn.is_finite()))
    if bad_grads.height:
        return []  # the gradients were already NaN/Inf: nonfinite_grads names that step
    stepped = window.filter(~pl.col("skipped").fill_null(False))
    u = int(upd_snap["step"]) if upd_snap else int((stepped if stepped.height else window)["step"].max())
    row = window.filter(pl.col("step") == u)
    loss = row["loss"][0] if row.height else None
    names = [frames.param_name(i) for i in layers]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    who = f"the weights of {len(names)} parameter(s)" if names else "weights"
    fin = f" (loss {loss:.4g})" if isinstance(loss, float) and math.isfinite(loss) else ""
    head = (f"{who} became NaN/Inf in the optimizer update of step {u}" + (f" ({shown})" if names else "")
            + f", whose gradients were all finite{fin}: the optimizer update produced the NaN/Inf, not the forward "
            "or the backward")
    if found is not None:
        span = f"step {prev}" if prev == s - 1 else f"steps {prev}..{s - 1} (layer rows every {s - prev} steps)"
        head += (f" (param_norm, taken before each step, was finite before and NaN/Inf at step {s}; "
                 f"the update of {span} did it)")
    causes = _causes(frames, layers)
    snap = upd_snap.file if upd_snap else snapshot_for(frames, s, frames.rank)
    if upd_snap:
        look = f"replay the update snapshot to see which factor went NaN/Inf: analyzer replay {snap}"
    elif snap:
        look = (f"replay {snap}: its weights are already NaN/Inf, and replay recomputes the update from its "
                "optimizer state")
    else:
        look = "record with Recorder(optimizer=opt, check_update=True) to get a snapshot of the update"
    why = f"likely cause: {'; or '.join(causes)}; " if causes else ""
    ev = {"step": u, "nonfinite_param_norm_step": s if found else None, "params": names[:20],
          "n_params": len(names), "loss": loss, "causes": causes, "snapshot": snap,
          "update_snapshot": upd_snap.file if upd_snap else None, "rank": frames.rank}
    return [Finding("nonfinite_weights", "error", u, f"{head}; {why}{look}", ev, rank=frames.rank)]


# -- stalled_updates ----------------------------------------------------------------------------
def _skip_affected(frames: Frames, lb: pl.DataFrame) -> np.ndarray:
    """Per bin row: a step the scaler skipped lies within the change the row measures (no update)."""
    sk = frames.steps.filter(pl.col("skipped").fill_null(False))["step"].to_numpy()
    if sk.size == 0:
        return np.zeros(lb.height, bool)
    sk = np.sort(sk)
    lo = lb["step_lo"].to_numpy() - _layer_every(frames)
    hi = lb["step_hi"].to_numpy()
    return np.searchsorted(sk, hi, side="right") > np.searchsorted(sk, lo, side="left")


def _layer_lr(frames: Frames, groups: list[dict], layer: int) -> float | None:
    if groups:
        g = _group_of(groups, layer)
        return _num(g.get("lr")) if g else None
    lr = frames.steps["lr"].drop_nulls()
    lr = lr.filter(lr.is_finite()) if lr.len() else lr
    return float(lr.median()) if lr.len() else None


def _stalled_rows(frames: Frames) -> tuple[pl.DataFrame, str] | None:
    lb = frames.layer_bins
    if lb is None:
        return None
    cols = "unch" in lb.columns
    if cols and int(lb["n_upd"].sum()) == 0:
        return None  # change columns without values (no second recorded row): nothing to judge
    if not cols and "pn_lo" not in lb.columns:
        return None
    sb = _stalled_bins(frames).sort("layer", "bin")
    sb = sb.with_columns(affected=pl.Series(_skip_affected(frames, sb)))
    normal = (pl.col("has_grad") & ~pl.col("stalled") & (pl.col("lg") > math.log10(ABS_SMALL))
              & (pl.col("pbad") == 0) & pl.col("pnorm").is_not_null() & ~pl.col("affected"))
    if cols:
        moved = pl.col("unch").is_not_null()
        still = pl.col("unch") >= UNCHANGED
    else:  # format < 3: a param_norm bitwise equal within the bin and to the previous bin's
        prev = pl.col("pn_hi").shift(1).over("layer")
        moved = prev.is_not_null()
        still = (pl.col("pn_lo") == pl.col("pn_hi")) & (pl.col("pn_lo") == prev)
    sb = sb.with_columns(eligible=(normal & moved).fill_null(False)).with_columns(
        still=(pl.col("eligible") & still).fill_null(False))
    return sb, "unchanged_frac" if cols else "param_norm"


def stalled_updates(frames: Frames) -> list[Finding]:
    """Parameters with normal gradients and lr > 0 whose weights stopped changing for many steps."""
    got = _stalled_rows(frames)
    if got is None:
        return []
    sb, basis = got
    cls, groups = _optimizer(frames)
    per = (sb.group_by("layer").agg(
        eligible=pl.col("eligible").sum(), still=pl.col("still").sum(),
        first=pl.col("step_lo").filter(pl.col("still")).min(),
        lg=pl.col("lg").filter(pl.col("eligible")).median(), pnorm=pl.col("pnorm").filter(pl.col("eligible")).median(),
        unch=(pl.col("unch").filter(pl.col("eligible")).median() if "unch" in sb.columns else pl.lit(None)),
        urms=(pl.col("urms").filter(pl.col("eligible")).median() if "urms" in sb.columns else pl.lit(None)))
        .filter((pl.col("still") >= MIN_ROWS) & (pl.col("still") > MOST * pl.col("eligible"))).sort("layer"))
    rows = []
    for r in per.iter_rows(named=True):
        layer = int(r["layer"])
        lr = _layer_lr(frames, groups, layer)
        if lr is None or lr <= 0:
            continue  # lr 0 or not in the optimizer: not stepping is expected
        numel = frames.numels[layer] if layer < len(frames.numels) and frames.numels[layer] else None
        dtype = _param_dtype(frames, layer)
        mag = float(r["pnorm"]) / math.sqrt(numel) if numel and r["pnorm"] is not None else None
        grms = 10 ** float(r["lg"]) / math.sqrt(numel) if numel and r["lg"] is not None else None
        adam = cls is not None and "adam" in cls.lower()
        expected = lr if adam else (lr * grms if grms is not None else None)
        rows.append({"name": frames.param_name(layer), "layer": layer, "dtype": dtype, "lr": lr,
                     "stalled_rows": int(r["still"]), "eligible_rows": int(r["eligible"]),
                     "unchanged_frac": r["unch"], "update_rms": r["urms"], "magnitude": mag,
                     "half_ulp": half_ulp(mag, dtype) if mag is not None else None,
                     "expected_update": expected, "first_step": r["first"]})
    if not rows:
        return []
    parts = []
    for x in rows[:6]:
        size = (f"typical update ~{x['expected_update']:.2g} ({'about lr for ' + cls if cls and 'adam' in cls.lower() else 'lr x gradient rms'})"
                if x["expected_update"] is not None else f"lr {x['lr']:.2g}")
        ulp = (f" vs half an ulp {x['half_ulp']:.2g} of its typical magnitude {x['magnitude']:.2g}"
               if x["half_ulp"] is not None else
               (f" against its typical magnitude {x['magnitude']:.2g}" if x["magnitude"] is not None else ""))
        parts.append(f"{x['name']} ({x['dtype'] or 'dtype unknown'}: unchanged on {x['stalled_rows']} of "
                     f"{x['eligible_rows']} recorded rows; {size}{ulp})")
    more = f" and {len(rows) - 6} more" if len(rows) > 6 else ""
    how = ("at least 90% of the sampled elements kept their bits (unchanged_frac)" if basis == "unchanged_frac" else
           "param_norm bitwise equal from row to row (this run predates the unchanged_frac column)")
    msg = (f"{len(rows)} parameter(s) stopped changing while their gradients are normal and lr > 0: "
           f"{'; '.join(parts)}{more}; {how}: their updates are smaller than half an ulp of the weights and round "
           f"away; fixes: {_FIXES}")
    first = min((x["first_step"] for x in rows if x["first_step"] is not None), default=None)
    ev = {"params": rows[:20], "n_params": len(rows), "basis": basis, "optimizer": cls,
          "thresholds": {"unchanged": UNCHANGED, "min_rows": MIN_ROWS, "most": MOST}}
    return [Finding("stalled_updates", "warning", first, msg, ev, rank=frames.rank)]
