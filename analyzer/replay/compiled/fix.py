"""The fix ``compile_disable``: the step compiled as in training, with the culprit module excluded (``torch.compiler.disable``).

It serves ``compile_specific`` when a module was found (``ReplayResult.compiled["module"]``); the
run is judged by the fix registry's shared ``_judge``, as every other fix is. A step that draws
random numbers is compiled with eager's (``fallback_random``), the masks of the FP32 replay it is
judged against.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..runs._runs import ReplayContext
from ..fixes.registry import Fix, FixSpec, _judge, register_fix
from ..result.replay_result import ReplayResult
from ._run import compiled_once
from .verdict import COMPILE_SPECIFIC

__all__: list[str] = []


def _title(module: str) -> str:
    return ("run the model eager (no torch.compile)" if module == "" else
            f"exclude `{module}` from compilation (torch.compiler.disable on its forward), the rest compiled as trained")


def _compile_disable(ctx: ReplayContext, result: ReplayResult) -> Fix:
    c = result.compiled
    module = c["module"]
    title = _title(module)
    same_masks = c.get("random") is not None  # judged against the FP32 eager replay: eager's dropout masks
    out = compiled_once(ctx, c["modules"], c["precision"], c["scale"], disable=module, same_masks=same_masks)
    if out.trace is None:
        return Fix(name="compile_disable", title=title, status="not_tried", precision=c["precision"],
                   detail=f"the compiled step could not run: {out.error}")
    masks = ", with eager's dropout masks" if same_masks else ""
    return _judge(result, "compile_disable", title, out.trace, note=f" (compiled as training compiled it{masks})")


def _line(fix: Fix, _c: Mapping, _mode: str) -> str:
    return f"{fix.title[0].upper()}{fix.title[1:]}: the step is finite that way."


def _applies(verdict: str, _c: Mapping) -> bool:
    return verdict == COMPILE_SPECIFIC


register_fix(FixSpec(
    "compile_disable", "the culprit module excluded from compilation (torch.compiler.disable)",
    _compile_disable, serves=(COMPILE_SPECIFIC,), line=_line, applies=_applies))
