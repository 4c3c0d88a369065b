"""The import rule: which code a snapshot may make the analyzer import.

A snapshot names its model factory and loss function as ``"module:function"`` strings, and the
built-in builders take class references the same way (HF's ``model_class``). Replay imports
them, so a file decides which code runs. This module is the one copy of the rule; the
recorder's ``to_ref`` and replay's ``resolve_ref`` both use it. Stdlib imports only: nothing
here imports torch or any module it is asked about, except ``import_ref`` once the rule allows.

The rule:
  1. Form ``module:name``: dotted identifiers, then ONE identifier (no attribute chains).
     The object must be a function or class *defined in* that module
     (``obj.__module__ == module`` and ``obj.__qualname__ == name``).
  2. The module's file is located (``PathFinder``, component by component, so no parent
     ``__init__`` runs) before anything is imported, and is imported only if it lies under an
     import root (``--path`` roots, the current directory), or is one of amp-autopsy's own
     modules (``OWN_MODULES``), or, for a builder's class argument, lies in the library the
     builder builds from (``BUILDER_CLASS_ARGS``). NB: a snapshot's recorded ``cwd`` is never a
     root by itself: it is the file's word, not the user's (a shared run directory would run
     its own code); replay from that directory, or name it with ``--path``, to trust it.
  3. The standard library, builtins, torch and site-packages are refused (an explicit
     ``--factory``/``--loss-fn`` is the user's own say-so and skips rule 2 and 3, not rule 1).
  4. No shadowing: the file Python would import (``sys.modules``, ``sys.meta_path``, with the
     roots *appended* to ``sys.path``) must be the file located in step 2.
"""
from __future__ import annotations

import contextlib as _contextlib
import contextvars as _contextvars
import dataclasses as _dataclasses
import difflib as _difflib
import importlib as _importlib
import importlib.machinery as _machinery
import os as _os
import re
import sys as _sys
import sysconfig as _sysconfig
import types as _types

__all__ = [
    "REFUSED_MODULES", "OWN_MODULES", "BUILDER_CLASS_ARGS", "ImportRuleError", "RefPlan",
    "parse_ref", "plan_ref", "import_ref", "import_roots",
]

# Top-level module names a reference may never resolve into (stdlib, builtins, torch).
REFUSED_MODULES = frozenset(_sys.stdlib_module_names) | frozenset(_sys.builtin_module_names) | {
    "builtins", "__main__", "torch", "torchvision", "torchaudio", "site", "sitecustomize", "usercustomize",
}

# amp-autopsy's own modules that replay may import wherever amp-autopsy is installed: the
# framework builders and the bundled samples' models and losses (``analyzer demo`` replays them).
# NB: only modules of builders and models. The scenario modules (``samples.healthy`` ...) define
# ``run(out_dir)``, which trains and writes files: a snapshot must not be able to call it.
OWN_MODULES = ("recorders.integrations.hf", "recorders.integrations.lightning", "samples.models",
               "amp_autopsy_samples.models")  # the samples in a checkout, and as a wheel installs them

# Built-in builders' class arguments: builder ref -> (kwarg name, base class ref, libraries the
# class may also come from). The class must subclass the base and be defined where it says.
BUILDER_CLASS_ARGS = {
    "recorders.integrations.hf:build_pretrained":
        ("model_class", "transformers:PreTrainedModel", ("transformers",)),
    "recorders.integrations.lightning:build_module":
        ("module_class", "lightning.pytorch:LightningModule", ("lightning", "pytorch_lightning")),
}

_REF_RE = re.compile(r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<name>[A-Za-z_]\w*)", re.ASCII)
_ROOTS: _contextvars.ContextVar[tuple[str, ...]] = _contextvars.ContextVar("amp_autopsy_import_roots", default=())


class ImportRuleError(ValueError):
    """A reference the rule refuses (``kind``: "form", "refused", "missing" or "mismatch"), or one that names
    nothing its module defines (``kind`` "undefined": a typo, worded as one, with "did you mean")."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@_dataclasses.dataclass(frozen=True)
class RefPlan:
    """What importing a reference would do, decided without importing anything.

    ``file`` is the module's file (None when not found); ``why`` says why it is allowed or not.
    """

    ref: str
    module: str | None
    name: str | None
    file: str | None
    allowed: bool
    why: str
    kind: str = "ok"  # "ok" | "form" | "refused" | "missing"


def parse_ref(ref, what: str = "factory") -> tuple[str, str]:
    """``"pkg.mod:build"`` -> ``("pkg.mod", "build")``; raises ImportRuleError on any other form."""
    m = _REF_RE.fullmatch(ref) if isinstance(ref, str) else None
    if m is None:
        raise ImportRuleError(
            f"{what} reference {ref!r} is not of the form 'pkg.module:function' "
            "(one function or class name after the colon, no dots)", "form")
    return m["module"], m["name"]


def import_roots(roots=()) -> _contextlib.AbstractContextManager[tuple[str, ...]]:
    """Context in which ``import_ref`` (and the builders' class arguments) may import from `roots`.

    The roots are *appended* to ``sys.path`` (so nothing in them shadows an installed module)
    for the duration, then removed again.
    """
    return _roots_context(tuple(roots))


@_contextlib.contextmanager
def _roots_context(roots: tuple[str, ...]):
    full = _effective_roots(roots)
    token = _ROOTS.set(full)
    added = [r for r in full if r not in _sys.path]
    _sys.path.extend(added)
    try:
        yield full
    finally:
        _ROOTS.reset(token)
        for r in added:
            with _contextlib.suppress(ValueError):
                _sys.path.remove(r)


def _effective_roots(roots) -> tuple[str, ...]:
    out: list[str] = []
    for r in [*roots, *_ROOTS.get(), _os.getcwd()]:
        if isinstance(r, str) and r and _os.path.isabs(r) and _os.path.isdir(r):
            real = _os.path.realpath(r)
            if real not in out and _os.path.dirname(real) != real:  # never a whole filesystem
                out.append(real)
    return tuple(out)


def _real(path) -> str | None:
    return _os.path.realpath(path) if isinstance(path, str) and _os.path.isabs(path) else None


def _under(path: str | None, folder: str) -> bool:
    return path is not None and (path == folder or path.startswith(folder.rstrip(_os.sep) + _os.sep))


def _refused_dirs() -> list[str]:
    """The standard library and site-packages folders of this interpreter (and its base)."""
    import site

    dirs: set[str] = set()
    for scheme_vars in ({}, {"base": _sys.base_prefix, "platbase": _sys.base_exec_prefix}):
        paths = _sysconfig.get_paths(vars=scheme_vars or None)
        dirs.update(paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    with _contextlib.suppress(Exception):
        dirs.update(site.getsitepackages())
    with _contextlib.suppress(Exception):
        dirs.add(site.getusersitepackages())
    dirs.update(p for p in _sys.path if _os.path.basename(p.rstrip(_os.sep)) in ("site-packages", "dist-packages"))
    return sorted({_os.path.realpath(d) for d in dirs if d and _os.path.isabs(d)})


def _find_under(module: str, root: str) -> list[str | None] | None:
    """Origins of each component of `module` found under `root` only; nothing is imported."""
    path, origins = [root], []
    parts = module.split(".")
    for i in range(len(parts)):
        spec = _machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        origins.append(_real(spec.origin) if spec.has_location else None)
        if i < len(parts) - 1:
            if spec.submodule_search_locations is None:
                return None
            path = list(spec.submodule_search_locations)
    return origins


def _meta_find(name: str, path):
    for finder in _sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(name, path) if find else None
        except Exception:  # noqa: BLE001 - a third-party finder failing is "not found"
            spec = None
        if spec is not None:
            return spec
    return None


def _python_view(module: str, roots: tuple[str, ...]) -> list[str | None] | None:
    """Origins of each component that ``import module`` would load, roots appended to sys.path.

    Reproduces the import system's search (``sys.modules``, then ``sys.meta_path``) without
    importing: what was already imported counts as what Python would use.
    """
    saved = list(_sys.path)
    _sys.path.extend(r for r in roots if r not in _sys.path)
    try:
        path, origins = None, []
        parts = module.split(".")
        for i in range(len(parts)):
            full = ".".join(parts[: i + 1])
            mod = _sys.modules.get(full)
            if mod is not None:
                spec = getattr(mod, "__spec__", None)
                origin = getattr(mod, "__file__", None) or getattr(spec, "origin", None)
                locs = getattr(mod, "__path__", None)
            else:
                spec = _meta_find(full, path)
                if spec is None:
                    return None
                origin = spec.origin if spec.has_location else None
                locs = spec.submodule_search_locations
            origins.append(_real(origin))
            if i < len(parts) - 1:
                if locs is None:
                    return None
                path = list(locs)
        return origins
    finally:
        _sys.path[:] = saved


def _own_file(module: str) -> str:
    install = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    return _os.path.join(install, *module.split(".")) + ".py"


def plan_ref(ref, roots=(), *, explicit: bool = False, libraries=(), what: str = "factory") -> RefPlan:
    """Decide, without importing anything, whether `ref` may be imported and from which file.

    Args:
        ref: ``"module:name"``.
        roots: extra import roots (``--path``); the current directory and the
            roots of an enclosing :func:`import_roots` are always added.
        explicit: the user typed this reference (``--factory``): any location is allowed.
        libraries: top-level packages a builder's class argument may also come from.
    """
    try:
        module, name = parse_ref(ref, what)
    except ImportRuleError as e:
        return RefPlan(str(ref), None, None, None, False, str(e), "form")
    top = module.split(".")[0]
    if top in REFUSED_MODULES and not explicit:  # decided on the name alone: no finder is even asked
        return RefPlan(ref, module, name, None, False,
                       f"{module!r} is in the standard library, builtins or torch, not model code", "refused")
    full = _effective_roots(roots)
    _importlib.invalidate_caches()  # files written since the last import are seen
    view = _python_view(module, full)
    file = view[-1] if view else None

    def plan(allowed: bool, why: str, kind: str, at: str | None = file) -> RefPlan:
        return RefPlan(ref, module, name, at, allowed, why, kind)

    if explicit:
        if file is None:
            return plan(False, f"cannot find module {module!r} on sys.path", "missing")
        return plan(True, "named explicitly on the command line", "ok")
    if module in OWN_MODULES:
        if file == _own_file(module):
            return plan(True, "amp-autopsy's own module", "ok")
        return plan(False, f"{module!r} would not be amp-autopsy's own file ({_own_file(module)})", "refused")
    if top in libraries and view and view[0] and all(_under(o, _os.path.dirname(view[0])) for o in view if o):
        return plan(True, f"part of {top}, which this builder builds from", "ok")
    cand, root = None, None
    for r in full:
        cand = _find_under(module, r)
        if cand is not None:
            root = r
            break
    where = "the --path roots and the current directory"
    if cand is None:
        bad = next((d for d in _refused_dirs() if _under(file, d)), None)
        if bad is not None:
            return plan(False, f"{module!r} is installed at {file}, in the standard library or site-packages, "
                               "which a snapshot may not name", "refused")
        if file is not None:
            return plan(False, f"{module!r} is at {file}, outside {where}", "refused")
        return plan(False, f"cannot find module {module!r} under {where}", "missing")
    if cand[-1] is None:
        return plan(False, f"{module!r} is a namespace package under {root}: it defines no {name!r}", "refused",
                    at=None)
    bad = next((d for d in _refused_dirs() for o in cand if _under(o, d)), None)
    if bad is not None:
        return plan(False, f"{module!r} is at {cand[-1]}, inside the standard library or site-packages ({bad})",
                    "refused", at=cand[-1])
    if view != cand:
        return plan(False, f"{module!r} at {cand[-1]} is shadowed: Python would import "
                           f"{file or 'another module'} instead", "refused", at=cand[-1])
    return plan(True, f"under {root}", "ok")


def _safe_dir(mod: _types.ModuleType) -> list[str]:
    """``dir(mod)``, which names a lazy module's attributes too (transformers'), importing nothing more."""
    try:
        return list(dir(mod))
    except Exception:  # noqa: BLE001 - a module whose own __dir__ fails: its namespace
        return list(vars(mod))


def _undefined(what: str, name: str, mod: _types.ModuleType) -> str:
    """``no function 'buld_model' in samples.models; did you mean 'build_model'?``: the closest of the
    module's top-level functions and classes defined there (difflib), if any is close."""
    defined = [k for k, v in vars(mod).items() if isinstance(v, (_types.FunctionType, type))
               and getattr(v, "__module__", None) == mod.__name__ and not k.startswith("__")]
    kind = "class" if what.endswith("class") else "function"
    close = _difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f" (it defines {len(defined)} functions and classes)"
    return f"no {kind} {name!r} in {mod.__name__}{hint}"


def import_ref(ref, roots=(), *, explicit: bool = False, base: type | None = None, libraries=(),
               what: str = "factory"):
    """Import the function or class `ref` names, if the rule allows it; raise ImportRuleError if not.

    Example:
        >>> import_ref("samples.models:build_mlp").__name__
        'build_mlp'
    """
    plan = plan_ref(ref, roots, explicit=explicit, libraries=libraries, what=what)
    if not plan.allowed:
        raise ImportRuleError(f"refusing {what} {ref!r}: {plan.why}" if plan.kind == "refused"
                              else f"cannot import {what} {ref!r}: {plan.why}" if plan.kind == "missing"
                              else plan.why, plan.kind)
    with _roots_context(tuple(roots)):
        mod = _importlib.import_module(plan.module)
    if not explicit and _real(getattr(mod, "__file__", None)) != plan.file:
        raise ImportRuleError(f"refusing {what} {ref!r}: importing {plan.module!r} loaded "
                              f"{getattr(mod, '__file__', None)}, not {plan.file}", "refused")
    obj = vars(mod).get(plan.name)
    if obj is None and plan.name not in _safe_dir(mod):  # a typo, not a refusal: the module has no such name
        raise ImportRuleError(_undefined(what, plan.name, mod), "undefined")
    if not isinstance(obj, (_types.FunctionType, type)) or obj.__module__ != plan.module \
            or obj.__qualname__ != plan.name:
        found = "nothing" if obj is None else f"{type(obj).__name__} {getattr(obj, '__module__', '?')}:" \
                                                f"{getattr(obj, '__qualname__', '?')}"
        raise ImportRuleError(f"refusing {what} {ref!r}: it must be a function or class defined in "
                              f"{plan.module}, found {found}", "mismatch")
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise ImportRuleError(f"{what} {ref!r} is not a subclass of {base.__module__}.{base.__qualname__}",
                              "mismatch")
    return obj
