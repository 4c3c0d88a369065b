"""How HF Trainer's ``torch_compile=True`` compiles the model: the ``compile`` entry its callback records.

The Trainer compiles inside ``accelerator.prepare`` (``torch.compile(model, **TorchDynamoPlugin(...).to_kwargs())``)
and hands its callbacks the uncompiled ``trainer.model``, so the model the callback sees carries no trace of it.
``trainer_compile_info`` rebuilds the plugin as ``Trainer`` builds it, from ``TrainingArguments``, and reads
its keyword arguments.

Example:
    >>> from types import SimpleNamespace
    >>> trainer_compile_info(SimpleNamespace(torch_compile=True, torch_compile_backend="inductor",
    ...                                      torch_compile_mode=None))["modules"][0]["mode"]
    'default'
"""
from __future__ import annotations

from typing import Any

__all__ = ["trainer_compile_info"]


def trainer_compile_info(args: Any) -> dict | None:
    """The ``compile`` entry (``recorders._compile.compile_info``'s form) of a Trainer run with `args`; None if uncompiled."""
    if not getattr(args, "torch_compile", False):
        return None
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    mode = getattr(args, "torch_compile_mode", None)
    kwargs: dict[str, Any] = {"backend": backend, "mode": mode}
    try:  # the plugin Trainer builds (transformers' Trainer.create_accelerator_and_postprocess)
        from accelerate.utils import TorchDynamoPlugin

        plugin = TorchDynamoPlugin(backend=backend, mode=mode, dynamic=False if backend == "neuron" else None)
        kwargs = dict(plugin.to_kwargs())  # NB: leaves out the values left at torch.compile's defaults
    except Exception:  # noqa: BLE001 - an accelerate without the plugin: the arguments as given
        pass
    dynamic, fullgraph, options = kwargs.get("dynamic"), kwargs.get("fullgraph", False), kwargs.get("options")
    entry = {"path": "", "how": "torch.compile", "backend": str(kwargs.get("backend") or backend).lower(),
             "mode": kwargs.get("mode") or "default",
             "dynamic": dynamic if isinstance(dynamic, bool) else None,
             "fullgraph": fullgraph if isinstance(fullgraph, bool) else None,
             "options": ({k: v for k, v in options.items() if isinstance(k, str)}
                         if isinstance(options, dict) and options else None)}
    return {"modules": [entry]}
