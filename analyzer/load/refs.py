"""User-code references of a snapshot (``pkg.mod:function``): resolve them, or plan what would be imported.

The import rule itself is the on-disk contract's (``recorders.schema``); this module maps its
refusals to ``FactoryError`` with the option that overrides them.
"""
from __future__ import annotations

import functools
import os

from recorders import schema

from ..errors import FactoryError

__all__ = ["plan_imports", "resolve_ref", "snapshot_roots"]


def resolve_ref(ref: str, *, what: str = "factory", option: str = "--factory", roots=(),
                explicit: bool = False):
    """Import the function or class ``"pkg.mod:name"`` names, under the import rule.

    The rule (``recorders.schema``, the import-rule section) refuses anything but a function or
    class defined in the module named, and imports a module only from an import root (`roots`:
    ``--path`` and the run's recorded cwd; the current directory is always one) or from
    amp-autopsy's own modules, never from the standard library, torch or site-packages, and
    never when another file would shadow it. ``explicit=True`` (``--factory``/``--loss-fn``) is
    the user's own say-so: the module may live anywhere, the form rule still holds.

    The callable returned runs inside ``schema.import_roots(roots)``, so a builder's class
    argument (HF's ``model_class``) is imported under the same roots, and ``sys.path`` is back
    to what it was between calls.
    """
    roots = tuple(roots)
    try:
        obj = schema.import_ref(ref, roots, explicit=explicit, what=what)
    except schema.ImportRuleError as e:
        raise FactoryError(str(e), fix=_ref_fix(e.kind, option)) from e
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is reported
        raise FactoryError(
            f"cannot import {what} {ref!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            fix=_ref_fix("missing", option),
        ) from e

    def call_under_roots(*args, **kwargs):
        with schema.import_roots(roots):
            return obj(*args, **kwargs)

    return functools.update_wrapper(call_under_roots, obj, updated=())


def _ref_fix(kind: str, option: str) -> str:
    if kind == "missing":
        return (f"pass --path DIR for the directory that holds the package, or run from it; or name it "
                f"yourself with {option} pkg.module:function, which is also found through PYTHONPATH")
    if kind == "form":
        return f"pass {option} pkg.module:function"
    return f"if you trust that code, name it yourself with {option} pkg.module:function"


def snapshot_roots(snap: dict, paths=()) -> tuple[str, ...]:
    """Import roots for a snapshot's references: ``--path`` roots first, then the recorded cwd.

    (The current directory is always added last by the rule itself.) A recorded cwd that is not
    an absolute path is ignored: older snapshots have none.
    """
    cwd = snap.get("cwd") if isinstance(snap, dict) else None
    recorded = (cwd,) if isinstance(cwd, str) and os.path.isabs(cwd) else ()
    return tuple(os.path.abspath(p) for p in paths) + recorded


def plan_imports(snap: dict, *, factory: str | None = None, loss_fn: str | None = None,
                 paths=()) -> list[dict]:
    """What replaying `snap` would import, from which file, and whether the rule allows it.

    Imports nothing (``analyzer replay --show``). One dict per reference: the factory, the
    loss function, and a built-in builder's class argument (HF's ``model_class``), with keys
    ``role``, ``ref``, ``file``, ``allowed``, ``why``, ``kind`` (``schema.RefPlan.kind``) and
    ``explicit``.
    """
    roots = snapshot_roots(snap, paths)
    rows = []
    for role, given, recorded in (("factory", factory, snap.get("factory")), ("loss_fn", loss_fn, snap.get("loss_fn"))):
        ref = given or recorded
        plan = schema.plan_ref(ref, roots, explicit=bool(given), what=role)
        rows.append({"role": role, "ref": ref, "file": plan.file, "allowed": plan.allowed, "why": plan.why,
                     "kind": plan.kind, "explicit": bool(given)})
        builder = schema.BUILDER_CLASS_ARGS.get(ref) if role == "factory" and plan.allowed else None
        kwargs = snap.get("factory_kwargs")
        if builder and isinstance(kwargs, dict):
            arg, base, libraries = builder
            sub = schema.plan_ref(kwargs.get(arg), roots, libraries=libraries, what=arg)
            rows.append({"role": f"factory_kwargs.{arg}", "ref": kwargs.get(arg), "file": sub.file,
                         "allowed": sub.allowed, "why": f"{sub.why}; must subclass {base}" if sub.allowed
                         else sub.why, "kind": sub.kind, "explicit": False})
    return rows
