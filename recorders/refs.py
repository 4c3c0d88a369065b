"""Turn a model factory or loss function into a ``"module:function"`` reference, and check it.

The rule itself (form, refused modules, where a module may be imported from) lives in
``recorders.imports``; this module applies it on the
training side, so a run never records a reference that replay would refuse.
"""
from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable

from . import imports

__all__ = ["to_ref", "import_class"]


def _check_refusable(module: str, ref: str, what: str) -> None:
    if module.split(".")[0] in imports.REFUSED_MODULES:
        raise ValueError(
            f"{what} {ref!r} is in the standard library, builtins or torch: replay refuses such "
            "references, so wrap it in a function of your own module"
        )


def to_ref(fn: str | Callable, what: str) -> str:
    """Return ``"pkg.mod:name"`` for `fn`, checking it the way replay will.

    Strings are checked for form only (the module may not be importable in the training
    process, e.g. when it is a path the analyzer will see). Callables must be functions or
    classes defined at the top level of an importable module: replay rebuilds the model from
    the name alone and refuses anything else (see ``recorders.imports``, the import rule).

    Example:
        >>> to_ref("samples.models:build_gpt", "factory")
        'samples.models:build_gpt'
    """
    if isinstance(fn, str):
        module, _ = imports.parse_ref(fn, what)
        _check_refusable(module, fn, what)
        return fn
    if not callable(fn):
        raise TypeError(f"{what} must be a 'pkg.module:function' string or a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(fn, (types.FunctionType, type)) or not module or not qualname:
        raise ValueError(
            f"{what} {fn!r} is not a plain function or class: replay imports it by name, so pass a "
            "module-level function (not a partial, method, builtin or callable object)"
        )
    if "<locals>" in qualname or "<lambda>" in qualname or "." in qualname:
        raise ValueError(
            f"{what} {fn!r} is not a top-level function: the analyzer rebuilds it by name, "
            "so define it at module level (not a lambda, a method or a nested function)"
        )
    if module == "__main__":
        raise ValueError(
            f"{what} {qualname!r} lives in __main__, which the analyzer cannot import: "
            "move it to an importable module or pass 'pkg.module:function'"
        )
    ref = f"{module}:{qualname}"
    imports.parse_ref(ref, what)
    _check_refusable(module, ref, what)
    resolved = vars(sys.modules[module]).get(qualname) if module in sys.modules else None
    if resolved is not fn:
        raise ValueError(f"{what} {ref!r} does not resolve back to the function given: define it at the "
                         "top level of its module under that name")
    _warn_if_replay_refuses(ref, what)
    return ref


def _warn_if_replay_refuses(ref: str, what: str) -> None:
    """Say at record time (once, at Recorder construction) what replay would refuse, and why.

    Typical case: a model package installed into site-packages (not ``pip install -e``), which
    replay refuses to import on a snapshot's word. Training goes on; the snapshot is still useful.
    """
    plan = imports.plan_ref(ref, what=what)
    if not plan.allowed:
        option = "--factory" if what == "factory" else "--loss-fn"
        warnings.warn(
            f"amp-autopsy: replay will not import {what} {ref!r} on the snapshot's word ({plan.why}); "
            f"replay from the directory that holds it, with --path DIR, or with {option} {ref}",
            stacklevel=3,
        )


def import_class(ref: str, base: type, what: str = "model_class", *, libraries=()) -> type:
    """Import the class named ``"pkg.mod:Class"`` under the import rule; check it subclasses `base`.

    Used by the framework adapters' factories, which rebuild a model from a class reference
    stored in a snapshot. The class must be defined in the module the reference names, which
    must lie under an import root (``recorders.imports.import_roots``: replay's ``--path`` and the
    current directory) or in one of `libraries` (the framework's own package).

    Raises:
        ValueError (``imports.ImportRuleError``): the rule refuses the reference.
    """
    return imports.import_ref(ref, base=base, libraries=libraries, what=what)
