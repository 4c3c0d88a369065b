"""A Lightning ``.ckpt`` -> the weights and ``build_module``'s kwargs; which LightningModule class it is.

A checkpoint stores the module's ``hyper_parameters`` but not its class (``load_from_checkpoint``
is called on the class). The class is, in order:

1. ``--factory`` (the user's say-so: it is called with the hyperparameters);
2. ``hyper_parameters["_class_path"]`` (LightningCLI stores it);
3. the one ``LightningModule`` subclass defined under ``--path`` or the current directory whose
   ``__init__`` takes exactly those hyperparameters, found by parsing the files (``ast``, nothing
   is imported or run here).

The import rule (``recorders.imports``) then decides at replay whether that module may be
imported: under ``--path`` or the current directory, never from where the checkpoint says.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

from recorders import imports

from ..errors import BadInputError, FactoryError
from ._ckpt import PL_BUILDER, PL_LOSS, _int_of, _scaler_scale, clean_state

__all__ = ["find_module_class", "lightning_checkpoint"]

_SKIP_DIRS = {"site-packages", "dist-packages", "node_modules", "__pycache__", "build", "dist"}
_MAX_FILES = 2000
_MAX_DEPTH = 3
_MAX_BYTES = 1 << 20


def lightning_checkpoint(p: Path, ck: dict, *, paths=(), explicit: bool = False) -> dict:
    """The fields ``adhoc`` needs from a loaded Lightning checkpoint dict."""
    state, notes = clean_state(ck["state_dict"], p)
    if not all(isinstance(k, str) for k in state):
        raise BadInputError("its state_dict has non-string keys", path=p, fix="pass a Lightning .ckpt")
    hp = ck.get("hyper_parameters")
    if hp is None:
        hp = {}
    if not isinstance(hp, dict) or not all(isinstance(k, str) for k in hp):
        raise BadInputError("its hyper_parameters are not a dict of name -> value", path=p,
                            fix="call self.save_hyperparameters() in the LightningModule's __init__")
    hparams = {k: v for k, v in hp.items() if k not in ("_class_path", "_instantiator")}
    ref = None
    if not explicit:
        cp = hp.get("_class_path")
        if isinstance(cp, str) and "." in cp:
            mod, _, name = cp.rpartition(".")
            ref = f"{mod}:{name}"
            notes.append(f"module class {ref}: the _class_path LightningCLI saved (imported under the import rule)")
        else:
            ref = find_module_class(hparams, p, paths)
            notes.append(f"module class {ref}: the LightningModule under --path or the current directory whose "
                         f"__init__ takes the checkpoint's hyper_parameters ({', '.join(sorted(hparams)) or 'none'})")
    return {"kind": "lightning", "what": "a Lightning checkpoint", "state": state, "factory": PL_BUILDER,
            "loss_fn": PL_LOSS, "factory_kwargs": {"module_class": ref, "hparams": hparams} if ref else hparams,
            "notes": notes, "step": _int_of(ck, ("global_step",)), "logs": None, "scaler_scale": _scaler_scale(ck),
            "optimizer_sd": opts[0] if isinstance(opts := ck.get("optimizer_states"), list) and len(opts) == 1
            and isinstance(opts[0], dict) else None}


def find_module_class(hparams: dict, p: Path, paths=()) -> str:
    """``pkg.mod:Class`` of the one LightningModule under the roots whose ``__init__`` fits `hparams`."""
    with imports.import_roots(tuple(os.path.abspath(r) for r in paths)) as roots:  # the rule's roots: never "/"
        pass
    found: dict[str, str] = {}  # file -> ref: a file under two roots is one class
    for root in roots:
        for ref, file, params, required, var_kw in _classes(Path(root)):
            if file not in found and set(required) <= set(hparams) and (var_kw or set(hparams) <= set(params)) \
                    and imports.plan_ref(ref, roots, what="module_class").allowed:  # importable as named
                found[file] = ref
    found = list(dict.fromkeys(found.values()))
    fix = ("run from the directory that holds the module's code, pass --path DIR, or name the class "
           "yourself with --factory pkg.mod:MyModule")
    if not found:
        raise FactoryError("the checkpoint does not name its LightningModule class, and no LightningModule "
                           "under --path or the current directory takes its hyper_parameters "
                           f"({', '.join(sorted(hparams)) or 'none'})", path=p, fix=fix)
    if len(found) > 1:
        raise FactoryError(f"the checkpoint does not name its LightningModule class, and {len(found)} under "
                           f"--path or the current directory take its hyper_parameters: {', '.join(found[:5])}",
                           path=p, fix="name the class with --factory pkg.mod:MyModule")
    return found[0]


def _classes(root: Path):
    """(ref, file, __init__ params, required params, has **kwargs) of each direct LightningModule subclass."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        depth = len(rel.parts)
        dirnames[:] = [] if depth >= _MAX_DEPTH else sorted(
            d for d in dirnames if d.isidentifier() and d not in _SKIP_DIRS and not d.startswith(".")
            and not (Path(dirpath) / d / "pyvenv.cfg").exists())
        for name in sorted(filenames):
            if not name.endswith(".py") or not name[:-3].isidentifier():
                continue
            count += 1
            if count > _MAX_FILES:
                return
            f = Path(dirpath) / name
            try:
                if f.stat().st_size > _MAX_BYTES:
                    continue
                tree = ast.parse(f.read_bytes(), filename=str(f))
            except (OSError, SyntaxError, ValueError, RecursionError):
                continue
            module = ".".join([*rel.parts, name[:-3]] if name != "__init__.py" else rel.parts)
            if not module:
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and any(_base_name(b) == "LightningModule" for b in node.bases):
                    yield (f"{module}:{node.name}", os.path.realpath(f), *_init_params(node))


def _base_name(b: ast.expr) -> str | None:
    return b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None


def _init_params(cls: ast.ClassDef) -> tuple[list[str], list[str], bool]:
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return [], [], False
    a = init.args
    pos = [x.arg for x in a.posonlyargs + a.args][1:]  # drop self
    n_def = len(a.defaults)
    required = pos[: len(pos) - n_def] + [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return pos + [x.arg for x in a.kwonlyargs], required, a.kwarg is not None
