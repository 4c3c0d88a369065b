"""User-code references of a snapshot (``pkg.mod:function``): resolve them, or plan what would be imported.

The import rule itself is ``recorders.imports``; this module maps its
refusals to ``FactoryError`` with the option that overrides them.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from recorders import imports

from ..errors import FactoryError
from .snapshot import Snapshot

__all__ = ["INSTALLED_SAMPLES", "missing_extra", "import_plan", "plan_imports", "recorded_cwd", "resolve_ref", "root_sources",
           "samples_package", "samples_roots", "snapshot_roots"]

# The bundled samples are the repository's ``samples/`` directory; a wheel installs them as
# ``amp_autopsy_samples`` (pyproject's package-dir), so installing amp-autopsy never claims the
# top-level name ``samples``, which other projects use. Both names are in ``imports.OWN_MODULES``.
INSTALLED_SAMPLES = "amp_autopsy_samples"


def resolve_ref(ref: str, *, what: str = "factory", option: str = "--factory", roots=(),
                explicit: bool = False, recorded: str | None = None):
    """Import the function or class ``"pkg.mod:name"`` names, under the import rule.

    The rule (``recorders.imports``) refuses anything but a function or
    class defined in the module named, and imports a module only from an import root (`roots`:
    ``--path``; the current directory is always one) or from amp-autopsy's own modules, never
    from the standard library, torch or site-packages, and never when another file would shadow
    it. ``explicit=True`` (``--factory``/``--loss-fn``) is the user's own say-so: the module may
    live anywhere, the form rule still holds.

    `recorded` (the snapshot's recorded cwd) is no root: a shared run directory must not run its
    own code. When the module is found only there, the error names the file and ``--path DIR``.

    The callable returned runs inside ``imports.import_roots(roots)``, so a builder's class
    argument (HF's ``model_class``) is imported under the same roots, and ``sys.path`` is back
    to what it was between calls.
    """
    ref = _own_name(ref)
    roots = _with_samples_root(ref, tuple(roots))
    try:
        obj = imports.import_ref(ref, roots, explicit=explicit, what=what)
    except imports.ImportRuleError as e:
        found = None if explicit or e.kind not in ("missing", "refused") else _found_elsewhere(ref, roots, recorded, what)
        if found is not None:
            folder, file = found
            where = "recorded at" if folder == recorded else "at"
            raise FactoryError(f"will not import {what} {ref!r} on the snapshot's word: the model code is {where} "
                               f"{file}; if you trust it, rerun with --path {shlex.quote(folder)} (or run from "
                               f"{shlex.quote(folder)})") from e
        raise FactoryError(str(e), fix=_ref_fix(e.kind, option)) from e
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is reported
        raise FactoryError(
            f"cannot import {what} {ref!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            fix=missing_extra(e) or _ref_fix("missing", option),
        ) from e

    def call_under_roots(*args, **kwargs):
        with imports.import_roots(roots):
            return obj(*args, **kwargs)

    return functools.update_wrapper(call_under_roots, obj, updated=())


# the optional extra that installs a package model code may import (pyproject's [project.optional-dependencies])
_EXTRAS = {"torchao": "fp8", "transformers": "hf", "accelerate": "hf", "lightning": "lightning",
           "pytorch_lightning": "lightning", "tensorboard": "tensorboard"}


def missing_extra(e: BaseException) -> str | None:
    """For model code that failed on a package one of amp-autopsy's extras installs (torchao for an FP8 model),
    the fix naming that extra; else None."""
    name = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    extra = _EXTRAS.get((name or "").partition(".")[0])
    if extra is None:
        return None
    return (f"the model code needs {name.partition('.')[0]}, from amp-autopsy's [{extra}] extra: "
            f"pip install 'amp-autopsy[{extra}]' (from a checkout: pip install -e '.[{extra}]')")


def _ref_fix(kind: str, option: str) -> str:
    if kind == "missing":
        return (f"pass --path DIR for the directory that holds the package, or run from it; or name it "
                f"yourself with {option} pkg.module:function, which is also found through PYTHONPATH")
    if kind == "form":
        return f"pass {option} pkg.module:function"
    if kind == "undefined":
        return f"check the name after the colon; pass {option} pkg.module:function to name another"
    return f"if you trust that code, name it yourself with {option} pkg.module:function"


def snapshot_roots(snap: Snapshot, paths=()) -> tuple[str, ...]:
    """Import roots for a snapshot's references: the ``--path`` roots.

    (The current directory is always added last by the rule itself.) The snapshot's recorded cwd
    is not one: it is the file's word, not the user's (``recorded_cwd``).
    """
    return tuple(os.path.abspath(p) for p in paths)


def root_sources(snap: Snapshot, paths=()) -> dict:
    """Where replay may import from, and why (``analyzer replay --show``).

    ``roots``: ``{"kind": "path" | "cwd" | "own", "dir"}`` in the order the rule tries them
    (``own``: amp-autopsy's install folder, for ``imports.OWN_MODULES`` only, listed in
    ``modules``); ``recorded_cwd``: ``{"dir", "root"}`` or None, ``root`` true only when it is
    the current directory or under a ``--path``, since the recorded cwd is never a root itself.
    """
    roots = [{"kind": "path", "dir": p} for p in snapshot_roots(snap, paths)]
    roots.append({"kind": "cwd", "dir": os.getcwd()})
    roots.append({"kind": "own", "dir": os.path.dirname(os.path.dirname(os.path.realpath(imports.__file__))),
                  "modules": list(imports.OWN_MODULES)})
    cwd = recorded_cwd(snap)
    inside = cwd is not None and any(
        cwd == os.path.realpath(r["dir"]) or cwd.startswith(os.path.realpath(r["dir"]).rstrip(os.sep) + os.sep)
        for r in roots if r["kind"] != "own")
    return {"roots": roots, "recorded_cwd": None if cwd is None else {"dir": cwd, "root": inside}}


def recorded_cwd(snap: Snapshot) -> str | None:
    """The training process's working directory the snapshot records (absolute), else None."""
    cwd = snap.cwd
    return os.path.realpath(cwd) if isinstance(cwd, str) and os.path.isabs(cwd) else None


def _found_elsewhere(ref: str, roots: tuple[str, ...], recorded: str | None, what: str) -> tuple[str, str] | None:
    """(folder, file) when `ref` would be allowed with one more root: the recorded cwd, else the
    folder above the package of the file Python would import (never amp-autopsy's own folder:
    its modules outside ``OWN_MODULES``, the scenario runners, stay refused). Imports nothing."""
    plan = imports.plan_ref(ref, roots, what=what)
    candidates = [recorded] if recorded else []
    if plan.file and plan.module:
        folder = Path(plan.file).parent
        depth = plan.module.count(".") + (Path(plan.file).name == "__init__.py")
        candidates.append(os.fspath(folder.parents[depth - 1]) if depth else os.fspath(folder))
    own = os.path.dirname(os.path.dirname(os.path.realpath(imports.__file__)))
    for folder in (c for c in candidates if os.path.realpath(c) != own):
        with_it = imports.plan_ref(ref, (*roots, folder), what=what)
        if with_it.allowed and with_it.file:
            return folder, with_it.file
    return None


def plan_imports(snap: Snapshot, *, factory: str | None = None, loss_fn: str | None = None,
                 paths=()) -> list[dict]:
    """What replaying `snap` would import, from which file, and whether the rule allows it.

    Imports nothing (``analyzer replay --show``). One dict per reference: the factory, the
    loss function, and a built-in builder's class argument (HF's ``model_class``), with keys
    ``role``, ``ref``, ``file``, ``allowed``, ``why``, ``kind`` (``imports.RefPlan.kind``) and
    ``explicit``.
    """
    roots = snapshot_roots(snap, paths)
    rows = []
    for role, given, recorded in (("factory", factory, snap.factory), ("loss_fn", loss_fn, snap.loss_fn)):
        ref = _own_name(given or recorded)
        plan = imports.plan_ref(ref, _with_samples_root(ref, roots), explicit=bool(given), what=role)
        rows.append({"role": role, "ref": ref, "file": plan.file, "allowed": plan.allowed, "why": plan.why,
                     "kind": plan.kind, "explicit": bool(given)})
        builder = imports.BUILDER_CLASS_ARGS.get(ref) if role == "factory" and plan.allowed else None
        kwargs = snap.factory_kwargs
        if builder and isinstance(kwargs, dict):
            arg, base, libraries = builder
            sub = imports.plan_ref(kwargs.get(arg), roots, libraries=libraries, what=arg)
            rows.append({"role": f"factory_kwargs.{arg}", "ref": kwargs.get(arg), "file": sub.file,
                         "allowed": sub.allowed, "why": f"{sub.why}; must subclass {base}" if sub.allowed
                         else sub.why, "kind": sub.kind, "explicit": False})
    return rows


def import_plan(path: str | os.PathLike, *, rank: int | None = None, factory: str | None = None,
                loss_fn: str | None = None, paths=()) -> dict:
    """``analyzer replay --show``: the snapshot at `path` (or `rank`'s of the same step), where
    replay may import from (``root_sources``) and what it would import (``plan_imports``).

    Reads the snapshot with weights_only and imports nothing. Returns ``{"snapshot", "roots",
    "recorded_cwd", "imports"}``, the ``--show --json`` object.
    """
    from .dcp import sibling_snapshot
    from .snapshot import load_snapshot

    shown = str(path) if rank is None else str(sibling_snapshot(path, rank))
    snap = load_snapshot(shown)
    return {"snapshot": shown, **root_sources(snap, paths),
            "imports": plan_imports(snap, factory=factory, loss_fn=loss_fn, paths=paths)}


def samples_package() -> str:
    """The bundled samples' package name: ``samples`` in a checkout, ``amp_autopsy_samples`` installed.

    A checkout (the source tree, or an editable install of it) is recognised by its
    ``pyproject.toml`` and ``samples/`` next to the ``analyzer`` package; its samples are then
    imported as ``samples`` from the repository root (``samples_roots``), unless another
    ``samples`` would shadow them. A ``samples`` of another project is never used.
    """
    roots = samples_roots()
    if not roots:
        return INSTALLED_SAMPLES
    init = os.path.join(roots[0], "samples", "__init__.py")
    mod = sys.modules.get("samples")
    if mod is not None:
        origin = getattr(mod, "__file__", None)
    else:
        with imports.import_roots(roots):  # appended, then removed: sys.path is left as it was
            spec = importlib.util.find_spec("samples")
        origin = spec.origin if spec is not None else None
    return "samples" if origin and os.path.realpath(origin) == init else INSTALLED_SAMPLES


def samples_roots() -> tuple[str, ...]:
    """``(repository root,)`` when amp-autopsy runs from a checkout, else ``()``: the import root
    under which ``samples`` is the checkout's own (for ``imports.import_roots``)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "samples" / "__init__.py").is_file():
        return (os.path.realpath(root),)
    return ()


def _own_name(ref):
    """A reference to the bundled samples under the name they have here: ``samples.models:NAME``
    installed is ``amp_autopsy_samples.models:NAME`` and the other way round in a checkout, so a
    run recorded in a checkout replays from a wheel, and one recorded from a wheel in a checkout."""
    if not isinstance(ref, str):
        return ref
    here = samples_package()
    for name in ("samples", INSTALLED_SAMPLES):
        if ref.startswith(name + ".") and name != here:
            return here + ref[len(name):]
    return ref


def _with_samples_root(ref, roots: tuple[str, ...]) -> tuple[str, ...]:
    """`roots`, plus the checkout's root for a reference into its ``samples.models`` (one of
    ``imports.OWN_MODULES``; never the scenario modules): an editable install run from another
    directory finds it there (``samples`` is not on its sys.path)."""
    module = ref.partition(":")[0] if isinstance(ref, str) else None
    if module in imports.OWN_MODULES and module.startswith("samples.") and samples_package() == "samples":
        return roots + tuple(r for r in samples_roots() if r not in roots)
    return roots
