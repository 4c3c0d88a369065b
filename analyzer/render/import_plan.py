"""Render ``analyzer replay --show``: the import plan of a snapshot, as the rule judged it.

Output on a snapshot of the demo run, from another folder (the paths are examples; the module list cut here)::

    snapshot: amp-autopsy-demo/fp16_attention_overflow/snapshots/step00000024-r00000-nonfinite_loss.pt
    import roots:
      current directory: /home/me/elsewhere
      amp-autopsy's own modules: /home/me/amp-autopsy (recorders.integrations.hf, ..., samples.models only)
      not a root: the recorded cwd /home/me/amp-autopsy (the snapshot's word; if you trust its code, pass --path ...)

    factory: 'samples.models:build_gpt'
      file: /home/me/amp-autopsy/samples/models.py
      rule: allowed: amp-autopsy's own module

    loss_fn: 'samples.models:gpt_loss'
      file: /home/me/amp-autopsy/samples/models.py
      rule: allowed: amp-autopsy's own module

    nothing was imported (replay without --show imports what is allowed above)

How to read it: ``import roots`` are the folders replay imports from, in the order it tries them;
each reference says which file it resolves to and whether the import rule allows it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["render_import_plan"]

_ROOT_LABEL = {"path": "--path", "cwd": "current directory", "own": "amp-autopsy's own modules"}


def render_import_plan(plan: dict[str, Any]) -> str:
    """The text of ``replay --show`` from the plan its ``--json`` prints.

    Args:
        plan: ``load.import_plan``'s ``{"snapshot", "roots", "recorded_cwd", "imports"}``.
    """
    lines = [f"snapshot: {plan['snapshot']}", "import roots:"] + [
        f"  {_ROOT_LABEL[r['kind']]}: {r['dir']}" + (f" ({', '.join(r['modules'])} only)" if r["kind"] == "own" else "")
        for r in plan["roots"]]
    rec = plan["recorded_cwd"]
    if rec is None:
        lines.append("  (the snapshot records no working directory)")
    elif not rec["root"]:
        lines.append(f"  not a root: the recorded cwd {rec['dir']} (the snapshot's word; if you trust its code, "
                     "pass --path with it or run from it)")
    for r in plan["imports"]:
        verdict = "allowed" if r["allowed"] else "REFUSED"
        lines += ["", f"{r['role']}: {r['ref']!r}" + ("  (given on the command line)" if r["explicit"] else ""),
                  f"  file: {r['file'] or ('(not found)' if r['kind'] == 'missing' else '(not looked up)')}",
                  f"  rule: {verdict}: {r['why']}"]
    lines += ["", "nothing was imported (replay without --show imports what is allowed above)"]
    return "\n".join(lines)
