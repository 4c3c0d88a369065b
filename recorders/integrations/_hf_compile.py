"""How HF Trainer's ``torch_compile=True`` compiles the model: the ``compile`` entry its callback records.

The Trainer compiles inside ``accelerator.prepare`` (``torch.compile(model, **TorchDynamoPlugin(...).to_kwargs())``)
and hands its callbacks the uncompiled ``trainer.model``, so the model the callback sees carries no trace of it.
``trainer_compile_info`` rebuilds the plugin as ``Trainer`` builds it, from ``TrainingArguments``, and reads
its keyword arguments.

Regional compilation (``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1``, which the plugin Trainer builds
reads; accelerate's ``compile_regions``) compiles the repeated blocks one by one and every other leaf
region alone, never the whole model: ``regions`` picks the same module paths by accelerate's own rule,
and the entry lists one module per region, which the compiled replay compiles as training did.

Example:
    >>> from types import SimpleNamespace
    >>> trainer_compile_info(SimpleNamespace(torch_compile=True, torch_compile_backend="inductor",
    ...                                      torch_compile_mode=None))["modules"][0]["mode"]
    'default'
"""
from __future__ import annotations

from typing import Any

__all__ = ["trainer_compile_info", "regions"]


def regions(model: Any) -> list[str]:
    """The module paths ``accelerate.utils.compile_regions(model)`` compiles, in its order.

    A ``ModuleList`` of blocks of one class: each block; a module holding such a list somewhere below it:
    its children, each by the same rule; any other module: itself ("" for the whole model).
    """
    from accelerate.utils.other import has_repeated_blocks, is_repeated_blocks

    def walk(module: Any, path: str) -> list[str]:
        join = (lambda name: f"{path}.{name}" if path else name)
        if is_repeated_blocks(module):
            return [join(name) for name, _ in module.named_children()]
        if has_repeated_blocks(module):
            return [p for name, child in module.named_children() for p in walk(child, join(name))]
        return [path]

    return walk(model, "")


def trainer_compile_info(args: Any, model: Any = None) -> dict | None:
    """The ``compile`` entry (``recorders.compiled.compile_info``'s form) of a Trainer run with `args`; None if uncompiled.

    With regional compilation and `model` (the Trainer's uncompiled model), one entry per region
    (``regions``); otherwise one entry for the whole model.
    """
    if not getattr(args, "torch_compile", False):
        return None
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    mode = getattr(args, "torch_compile_mode", None)
    kwargs: dict[str, Any] = {"backend": backend, "mode": mode}
    paths = [""]
    try:  # the plugin Trainer builds (transformers' Trainer.create_accelerator_and_postprocess)
        from accelerate.utils import TorchDynamoPlugin

        plugin = TorchDynamoPlugin(backend=backend, mode=mode, dynamic=False if backend == "neuron" else None)
        kwargs = dict(plugin.to_kwargs())  # NB: leaves out the values left at torch.compile's defaults
        if getattr(plugin, "use_regional_compilation", False) and model is not None:
            paths = regions(model)  # accelerate.prepare compiles these, not the whole model
    except Exception:  # noqa: BLE001 - an accelerate without the plugin: the arguments as given
        pass
    dynamic, fullgraph, options = kwargs.get("dynamic"), kwargs.get("fullgraph", False), kwargs.get("options")
    entry = {"path": "", "how": "torch.compile", "backend": str(kwargs.get("backend") or backend).lower(),
             "mode": kwargs.get("mode") or "default",
             "dynamic": dynamic if isinstance(dynamic, bool) else None,
             "fullgraph": fullgraph if isinstance(fullgraph, bool) else None,
             "options": ({k: v for k, v in options.items() if isinstance(k, str)}
                         if isinstance(options, dict) and options else None)}
    return {"modules": [dict(entry, path=p) for p in paths]}
