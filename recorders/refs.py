"""Turn a model factory or loss function into a ``"module:qualname"`` reference, and check it."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["to_ref", "import_class"]

# A snapshot must not be able to name os:system: references into these roots are refused
# (analyzer.loaders.resolve_ref applies the same rule to factories and loss functions).
REFUSED_ROOTS = frozenset(sys.stdlib_module_names) | {"builtins", "__main__", "torch"}


def _resolve(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def to_ref(fn: str | Callable, what: str) -> str:
    """Return ``"pkg.mod:qualname"`` for `fn`, checking that the name resolves back to it.

    Strings are checked for form only (the module may not be importable in the training
    process, e.g. when it is a path the analyzer will see). Callables must be importable
    top-level objects, since the analyzer rebuilds the model from the name alone.

    Example:
        >>> to_ref("samples.models:build_gpt", "factory")
        'samples.models:build_gpt'
    """
    if isinstance(fn, str):
        module, sep, qualname = fn.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"{what} must look like 'pkg.module:function', got {fn!r}")
        return fn
    if not callable(fn):
        raise TypeError(f"{what} must be a 'pkg.module:function' string or a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{what} {fn!r} is not a top-level function: the analyzer rebuilds it by name, "
            "so define it at module level (not a lambda or a nested function)"
        )
    if module == "__main__":
        raise ValueError(
            f"{what} {qualname!r} lives in __main__, which the analyzer cannot import: "
            "move it to an importable module or pass 'pkg.module:function'"
        )
    ref = f"{module}:{qualname}"
    try:
        resolved = _resolve(ref)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {ref!r} does not resolve back to the function: {e}") from e
    if resolved is not fn:
        raise ValueError(f"{what} {ref!r} resolves to a different object than the one given")
    return ref


def import_class(ref: str, base: type, what: str = "model_class") -> type:
    """Import the class named ``"pkg.mod:Class"`` and check that it subclasses `base`.

    Used by the framework adapters' factories, which rebuild a model from a class reference
    stored in a snapshot. References into the standard library, builtins or torch are refused.
    """
    module, sep, qualname = str(ref).partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"{what} must look like 'pkg.module:Class', got {ref!r}")
    if module.split(".")[0] in REFUSED_ROOTS:
        raise ValueError(f"refusing {what} {ref!r}: it resolves into the standard library or torch")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{what} {ref!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return obj
