"""The click options ``analyzer``'s commands share: a checkpoint and its batch, overrides, replay, --fail-on, --steps."""
from __future__ import annotations

import click

from .findings import EXIT_FAIL_ON

__all__ = ["checkpoint_options", "device_option", "fail_on_option", "json_option", "override_options",
           "parse_steps", "replay_options"]


def parse_steps(ctx, param, value):
    """``--steps A:B`` as (A, B), an open end None."""
    if value is None:
        return None
    lo, sep, hi = value.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise click.BadParameter("expected A:B, A: or :B with integer steps, e.g. 100:500") from None


def checkpoint_options(fn):
    """``--batch``, ``--amp``, ``--scale``: replay a checkpoint (no recorder snapshot) with the failing step's batch."""
    fn = click.option("--scale", type=float, default=None, metavar="S",
                      help="With --batch: the loss scale of the failing step. Default: 1 for BF16; for FP16 the "
                           "GradScaler state saved with the checkpoint, else GradScaler's default 65536.")(fn)
    fn = click.option("--accumulate", type=click.Choice(["auto", "mean", "sum", "join"]), default=None,
                      help="With --batch FILE holding a list of micro-batches: how training combined their losses. "
                           "mean: each loss / N; sum: undivided; join: replay their concatenation as one batch. "
                           "Default auto: HF's num_items_in_batch when every micro-batch carries it, else mean.")(fn)
    fn = click.option("--amp", type=click.Choice(["fp16", "bf16"]), default=None,
                      help="With --batch: the precision the run trained in (default fp16).")(fn)
    return click.option("--batch", "batch", type=click.Path(exists=True, dir_okay=False, path_type=str),
                        default=None, metavar="FILE",
                        help="Replay a checkpoint instead of a snapshot: a state_dict (.pt, .safetensors; with "
                             "--factory and --loss-fn), an HF checkpoint directory or a Lightning .ckpt, with FILE, "
                             "the failing step's batch saved by torch.save(batch, FILE) (HF Trainer: callbacks="
                             "[recorders.integrations.hf.save_batch_on_nan(FILE)]).")(fn)


def override_options(fn):
    """``--rng FILE`` (with --batch) and ``--factory-kwargs JSON``: what the command line says over the files'."""
    fn = click.option("--factory-kwargs", "factory_kwargs", default=None, metavar="JSON",
                      help="Keyword arguments for the model factory, a JSON object merged over the recorded ones, "
                           "e.g. '{\"width\": 64}'.")(fn)
    return click.option("--rng", "rng", type=click.Path(exists=True, dir_okay=False, path_type=str), default=None,
                        metavar="FILE", help="With --batch: the failing step's RNG state, saved at the step's start "
                                             "by torch.save({'cpu': torch.get_rng_state(), 'cuda': "
                                             "torch.cuda.get_rng_state_all()}, FILE).")(fn)


def fail_on_option(when: str, printed: str):
    """``--fail-on SEVERITY``: exit EXIT_FAIL_ON (4) when `when` (``findings.exit_status``)."""
    return click.option("--fail-on", "fail_on", type=click.Choice(["error", "warning"]), default=None,
                        help=f"Exit with status {EXIT_FAIL_ON} when {when} (to gate a pipeline); {printed} is "
                             "printed as usual.")


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object to stdout.")
device_option = click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
    help="Where to replay: cuda when present (auto), else cpu.")


def replay_options(*, culprit: str | None, snapshot: str):
    """The options ``replay`` and ``autopsy`` share: --ops (without a `culprit`, none), --factory, --loss-fn, --path."""
    options = [
        click.option("--ops", default=8, show_default=True, type=click.IntRange(0, None),
                     help=f"Ops to show around {culprit}."),
    ] if culprit is not None else []
    options += [
        click.option("--factory", default=None, metavar="REF", help="Override the model factory, pkg.mod:function."),
        click.option("--loss-fn", "loss_fn", default=None, metavar="REF",
                     help="Override the loss function, pkg.mod:function."),
        click.option("--path", "paths", multiple=True, metavar="DIR",
                     type=click.Path(exists=True, file_okay=False, resolve_path=True, path_type=str),
                     help=f"Also import {snapshot} factory and loss function from under DIR "
                          "(repeatable)."),
    ]

    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply
