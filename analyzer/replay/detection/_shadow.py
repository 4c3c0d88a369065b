"""Shadow check: recompute one op in FP32 and FP64 from upcast copies of its low-precision inputs.

If the op is finite in FP32 from the very same inputs, the low-precision op simply ran out of
range (overflow). If it is non-finite in FP32 too, the inputs themselves are the problem: either
they already lost information in low precision (underflow: a value flushed to zero) or the op
is a real numerical bug (log(0), 0/0).
"""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__: list[str] = []

_LOW = (torch.float16, torch.bfloat16)


def shadow(func_name: str, overload: str, captured, low_dtype: torch.dtype | None) -> dict:
    """Recompute the op named ``namespace.op`` + overload on upcast inputs.

    Returns ``{"float32": absmax, "float64": absmax, "error": None|str}``; absmax is NaN/inf
    when the recomputed output is non-finite. ``low_dtype`` arguments (e.g. ``_to_copy``'s
    target dtype) are replaced by the shadow dtype too, so a cast is re-done without the cast.
    """
    out: dict = {"float32": None, "float64": None, "error": None}
    if captured is None:
        out["error"] = "inputs were not captured"
        return out
    try:
        func = _resolve_op(func_name, overload)
    except (AttributeError, RuntimeError) as e:
        out["error"] = f"cannot resolve {func_name}.{overload}: {e}"
        return out
    args, kwargs = captured
    for dtype in (torch.float32, torch.float64):
        def up(x, dtype=dtype):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.to(dtype)
            if isinstance(x, torch.dtype) and (x in _LOW or x == low_dtype):
                return dtype
            return x

        try:
            a, k = tree_map(up, (args, kwargs))
            with torch.no_grad():
                result = func(*a, **k)
        except Exception as e:  # noqa: BLE001 - e.g. an op without an FP64 kernel
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            continue
        flat, _ = tree_flatten(result)
        vals = [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if vals:
            mm = [torch.aminmax(t) for t in vals]
            out[str(dtype).removeprefix("torch.")] = max(
                (max(abs(float(mn)), abs(float(mx))) for mn, mx in mm),
                key=lambda v: (math.isnan(v), v),
            )
    return out


def _resolve_op(name: str, overload: str):
    namespace, op = name.split(".", 1)
    packet = getattr(getattr(torch.ops, namespace), op)
    return getattr(packet, overload)
