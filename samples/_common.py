"""What the sample scenarios share: the recorded AMP training loop, synthetic data and the command line.

Every scenario is a few lines of configuration over :func:`train`, which is an ordinary
GradScaler loop with the recorder added, exactly as a user would add it::

    rec.begin_step(step, batch)
    with torch.autocast("cpu", dtype=amp_dtype):
        loss = loss_fn(model, batch)
    scaler.scale(loss).backward()
    rec.end_step(loss)
    scaler.step(opt); scaler.update()
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from recorders import Recorder, schema

__all__ = ["one_thread", "train", "gpt_batches", "teacher_batches", "teacher_weights", "main", "snapshots_of", "Progress"]

Progress = Callable[[str], object]


def _autocast(amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=amp_dtype)


def train(
    out_dir: str | Path,
    *,
    name: str,
    model: nn.Module,
    factory: str,
    factory_kwargs: dict,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor],
    batches: Iterator[dict],
    steps: int,
    amp_dtype: torch.dtype | None,
    optimizer: torch.optim.Optimizer,
    use_scaler: bool,
    progress: Progress | None = None,
    forward: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    snapshot_last: bool = False,
    print_every: int = 10,
    before_step: Callable[[nn.Module, int], object] | None = None,
    init_scale: float = 2.0**16,
) -> Path:
    """Train `model` for `steps` batches on CPU with the recorder on; return the run directory.

    Args:
        out_dir: the run directory the recorder writes (created if missing).
        name: the scenario's name, for progress lines.
        factory / factory_kwargs / loss_fn: what the recorder stores so the replay can rebuild
            the model and re-run the loss.
        forward: what the loop itself calls to get the loss, when it is not
            ``loss_fn`` under autocast (loss_outside_autocast computes its loss differently).
        before_step: called as ``before_step(model, step)`` before ``begin_step``, for a
            schedule the loop applies to the model (fp16_attention_overflow's temperature).
        init_scale: the GradScaler's first scale (its default, 65536, unless a scenario says why).
        snapshot_last: force a snapshot of the last step (``reason="manual"``), so a run that
            never fails still has a step to replay.
        progress: called with one line of text every `print_every` steps and for every
            snapshot the recorder writes; None prints nothing.
    """
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if use_scaler else None
    rec = Recorder(out_dir, model, factory=factory, factory_kwargs=factory_kwargs, loss_fn=loss_fn,
                   scaler=scaler, amp_dtype=amp_dtype, optimizer=optimizer)
    model.train()
    with one_thread(), rec:
        for step in range(steps):
            batch = next(batches)
            if before_step is not None:
                before_step(model, step)
            rec.begin_step(step, batch)
            optimizer.zero_grad(set_to_none=True)
            if forward is not None:
                loss = forward(model, batch)
            else:
                with _autocast(amp_dtype):
                    loss = loss_fn(model, batch)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            n_snaps = len(rec.snapshots)
            rec.end_step(loss)
            if snapshot_last and step == steps - 1:
                rec.snapshot(reason="manual")
            if progress is not None and (step % print_every == 0 or step == steps - 1):
                scale = "" if scaler is None else f"  scale {scaler.get_scale():g}"  # host syncs, for printing
                progress(f"[{name}] step {step:3d}/{steps}  loss {loss.item():.4g}{scale}")
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if progress is not None:
                for path in rec.snapshots[n_snaps:]:
                    progress(f"[{name}] step {step:3d}: snapshot {path.name}")
    return Path(out_dir)


@contextlib.contextmanager
def one_thread():
    """Run on one intra-op thread, then restore the caller's setting.

    Models this small only lose time to thread hand-offs (on a busy 2-core machine a scenario
    took 2-3x longer on 2 threads), and one thread makes the FP16 rounding, hence the step at
    which a scenario fails, the same from run to run.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gpt_batches(*, vocab_size: int, block_size: int, batch_size: int, seed: int) -> Iterator[dict]:
    """Endless batches of arithmetic sequences mod `vocab_size` (``start + k*t``, k in 1..3).

    The next token is predictable from the previous two, so a working model learns it and
    attention has something to attend to. Deterministic for a given `seed`.
    """
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(block_size + 1)
    while True:
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
        k = torch.randint(1, 4, (batch_size, 1), generator=g)
        seq = (start + k * t) % vocab_size
        yield {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}


def teacher_batches(*, in_features: int, n_classes: int, batch_size: int, seed: int,
                    label_noise: float = 0.1) -> Iterator[dict]:
    """Endless classification batches labelled by a fixed random linear teacher.

    ``x ~ N(0, 1)``, ``y = argmax(x @ W)``, with a fraction `label_noise` of labels replaced by
    random classes. Deterministic for a given `seed`.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_features, n_classes, generator=g)  # == teacher_weights(...)
    while True:
        x = torch.randn(batch_size, in_features, generator=g)
        y = (x @ teacher).argmax(1)
        noisy = torch.rand(batch_size, generator=g) < label_noise
        y = torch.where(noisy, torch.randint(0, n_classes, (batch_size,), generator=g), y)
        yield {"x": x, "y": y}


def teacher_weights(*, in_features: int, n_classes: int, seed: int) -> torch.Tensor:
    """The teacher matrix that ``teacher_batches`` with the same arguments labels by."""
    return torch.randn(in_features, n_classes, generator=torch.Generator().manual_seed(seed))


def snapshots_of(run_dir: str | Path) -> list[Path]:
    """The snapshot files of `run_dir`, oldest step first."""
    return sorted((Path(run_dir) / schema.SNAPSHOT_DIR).glob(schema.SNAPSHOT_GLOB))


def main(run: Callable[..., Path], doc: str | None, *, default_steps: int, extra: dict | None = None) -> None:
    """``python -m samples.NAME --out DIR [--steps N] [--quiet]``: run a scenario from the shell.

    `extra` maps further option names to ``add_argument`` keywords; their values are passed to
    `run` as keyword arguments (``--amp bf16`` -> ``amp="bf16"``).
    """
    summary = doc.strip().splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument("--out", required=True, help="run directory to write")
    parser.add_argument("--steps", type=int, default=default_steps, help="training steps (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    for option, kwargs in (extra or {}).items():
        parser.add_argument(option, **kwargs)
    args = parser.parse_args()
    dests = [option.lstrip("-").replace("-", "_") for option in extra or {}]
    more = {dest: getattr(args, dest) for dest in dests}
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    run_dir = run(args.out, steps=args.steps, progress=None if args.quiet else print, **more)
    snaps = snapshots_of(run_dir)
    print(f"run directory: {run_dir}")
    for s in snaps:
        print(f"snapshot: {s}")
    print(f"next: analyzer report {run_dir}" + (f"  |  analyzer replay {snaps[0]}" if snaps else ""))
