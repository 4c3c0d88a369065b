"""The ``analyzer`` command line: parses options, calls the library, renders. Nothing else.

Exit statuses (documented in docs/; scripts rely on them):

- 0: the command ran (a report may still contain findings);
- 1: bad input, one ``Error: FILE: what (fix)`` line (``analyzer.errors``, OS errors); ``autopsy``
  also exits 1, after printing the report and the other replays, when a snapshot it picked could not
  be replayed (the ``Error:`` line names that snapshot);
- 2: a usage error (click's own);
- 3: an internal error: any other exception, printed as one ``Error: FILE: internal error while
  <stage>: <type>: <message> (please report this with the file)`` line; ``analyzer --debug ...``
  adds the traceback. ``report`` (and ``autopsy``) also exits 3, after printing the report, when one
  of its checks raised (a ``check_failed`` finding);
- 4: ``report --fail-on SEVERITY``, ``autopsy --fail-on SEVERITY`` (on the report's findings) or
  ``inspect --fail-on SEVERITY`` found a finding of that severity or worse.

Everything printed goes through ``_terminal.escape_controls``: names read from files cannot send
escape sequences to the terminal. Warnings raised while a command runs are held back, dropped if
the command fails (the ``Error:`` line stays the only line) and printed after its output otherwise.
"""
from __future__ import annotations

import json
import sys

import click

from .load import ARCHIVE_RATIO_ENV, DEFAULT_ARCHIVE_RATIO, archive_ratio_limit
from ._cli_options import (checkpoint_options, device_option, fail_on_option, json_option, override_options,
                           parse_steps, replay_options)
from ._cli_errors import EXIT_INTERNAL, one_line as _one_line, one_line_errors as _one_line_errors
from ._terminal import escape_controls
from ._torchrun import under_torchrun

__all__ = ["main", "EXIT_INTERNAL"]


def _echo(text: str = "", **kwargs) -> None:
    """click.echo with control characters from file-provided names made visible."""
    click.echo(escape_controls(str(text)), **kwargs)


def _print_json(obj) -> None:
    buf, held = [], 0  # streamed in ~64 KiB pieces: the text of 100k tensors' entries is never held whole
    for chunk in json.JSONEncoder(indent=2, allow_nan=False, default=str).iterencode(obj):
        buf.append(chunk)
        held += len(chunk)
        if held >= 1 << 16:
            click.echo("".join(buf), nl=False)
            buf, held = [], 0
    click.echo("".join(buf))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="amp-autopsy")
@click.option("--debug", is_flag=True, help="On an internal error (exit 3), print the traceback too.")
@click.option("--max-archive-ratio", type=click.FloatRange(min=0, min_open=True), default=None,
              envvar=ARCHIVE_RATIO_ENV, show_envvar=True, metavar="N",
              help=f"Refuse torch files whose zip archive declares more than N times the file's size "
                   f"(plus 1 MiB) uncompressed: a zip bomb is refused before decompression. "
                   f"Default {DEFAULT_ARCHIVE_RATIO:g}.")
@click.pass_context
def main(ctx, debug, max_archive_ratio) -> None:
    """amp-autopsy: find out why a mixed-precision (FP16/BF16) training run went NaN.

    Exit status: 0 ran, 1 bad input, 2 usage error, 3 internal error (please report it).
    """
    ctx.obj = {"debug": debug}
    ctx.with_resource(archive_ratio_limit(max_archive_ratio))  # for this command's reads only


def _open_target(path, command, batch, amp, scale, accumulate, *, rng=None, factory_kwargs=None, **kw):
    """What PATH (and --batch) name, opened by ``load.target`` (a snapshot, a run, or a checkpoint and its batch);
    `factory_kwargs` already parsed (``_factory_kwargs``)."""
    from .load.target import open_target

    if batch is None and (amp is not None or scale is not None or accumulate is not None):
        raise click.UsageError("--amp, --scale and --accumulate go with --batch (a checkpoint and its failing batch)")
    if batch is None and rng is not None:
        raise click.UsageError("--rng goes with --batch (a recorder snapshot holds its own RNG state)")
    return open_target(path, command=command, batch=batch, amp=amp, scale=scale, accumulate=accumulate, rng=rng,
                       factory_kwargs=factory_kwargs, **kw)


def _factory_kwargs(text):
    from .load.overrides import parse_factory_kwargs

    return None if text is None else parse_factory_kwargs(text)


@main.command(epilog="After a crash without a recorder: torch.save(batch, 'batch.pt') in the loop when the loss "
                     "is NaN, then: analyzer replay model.pt --batch batch.pt --factory pkg.mod:build --loss-fn "
                     "pkg.mod:loss (HF and Lightning checkpoints need neither).")
@click.argument("snapshot", type=click.Path(path_type=str))  # a directory gets the command that reads it
@checkpoint_options
@json_option
@device_option
@click.option("--dtypes", default=None, metavar="LIST",
              help="Precisions to replay, e.g. fp32,fp16,bf16. Default: fp32 and the run's AMP dtype, and bf16 "
                   "(at loss scale 1) when the advice would be to switch to it.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write a PNG of per-op abs-max along execution order (for an update snapshot: the update "
                   "forensics, per parameter).")
@replay_options(culprit="the culprit", snapshot="the snapshot's")
@click.option("--show", is_flag=True,
              help="Print what replay would import, from which file, and whether the import rule allows "
                   "it; import nothing, replay nothing.")
@click.option("--rank", type=click.IntRange(0, None), default=None,
              help="Replay this rank's snapshot of the same step: the file beside SNAPSHOT with the same "
                   "step and reason (FSDP and DDP runs write one per rank).")
@click.option("--steps", "window", type=click.IntRange(1, None), default=None, metavar="K",
              help="Also replay the K steps up to the snapshot's from its rewind window (Recorder(rewind=K)), in "
                   "FP32 and the run's precision from one state: where they part, and whether FP32 spikes.")
@override_options
@_one_line_errors
def replay(snapshot, batch, amp, accumulate, scale, as_json, device, dtypes, plot_path, ops, factory, loss_fn, paths, show,
           rank, window, rng, factory_kwargs):
    """Re-run a failing step in FP32 and FP16/BF16 and name the first op that made NaN/Inf.

    SNAPSHOT is a recorder snapshot, or with --batch a checkpoint.
    """
    if batch is not None and (show or rank is not None):
        raise click.UsageError("--show and --rank read recorder snapshots, not a checkpoint with --batch")
    if show and (rng is not None or factory_kwargs is not None or window):
        raise click.UsageError("--show prints what the snapshot names; --rng, --factory-kwargs and --steps go with "
                               "a replay")
    if show:
        _show_imports(snapshot, rank, factory, loss_fn, paths, as_json)
        return
    if under_torchrun():  # torchrun --nproc-per-node N -m analyzer replay SNAPSHOT: every rank replays its shards
        from ._cli_distributed import distributed_command

        distributed_command(snapshot, _print_json if as_json else None, device=device, factory=factory,
                            loss_fn=loss_fn, paths=paths, dtypes=dtypes,
                            unsupported={"--batch": batch, "--rank": rank, "--plot": plot_path, "--rng": rng,
                                         "--factory-kwargs": factory_kwargs, "--steps": window})
        return
    from .render import check_output_path, plot_replay, render_replay_text, render_window_text
    from .replay import Replay
    from .replay.window import replay_window, require_window

    if plot_path:
        check_output_path(plot_path, inputs=[snapshot] + ([batch] if batch else []), option="--plot")
    dtype_list = None if dtypes is None else [d.strip() for d in dtypes.split(",") if d.strip()]
    target = _open_target(snapshot, "replay", batch, amp, scale, accumulate, factory=factory, loss_fn=loss_fn,
                          device=device, paths=paths, rng=rng, factory_kwargs=_factory_kwargs(factory_kwargs),
                          rank=rank)
    rp = Replay(target.source, device=device, dtypes=dtype_list, factory=factory, loss_fn=loss_fn,
                progress=sys.stderr.isatty() and not as_json, paths=paths,
                rank=rank if isinstance(target.source, str) else None)  # a loaded snapshot is that rank's
    if window:
        require_window(rp)  # before the replay: a snapshot without a window is refused at once
    result = rp.run()
    win = replay_window(rp, window) if window else None
    if plot_path:
        plot_replay(result, plot_path)
    if as_json:
        _print_json({**result.to_dict(), **({"window": win.to_dict()} if win is not None else {})})
    else:
        _echo(render_replay_text(result, ops=ops) + ("\n\n" + render_window_text(win) if win is not None else ""))


def _show_imports(snapshot, rank, factory, loss_fn, paths, as_json) -> None:
    """``replay --show``: the import plan of a snapshot, read with weights_only, nothing imported."""
    from .load import import_plan
    from .render import render_import_plan

    plan = import_plan(snapshot, rank=rank, factory=factory, loss_fn=loss_fn, paths=paths)
    if as_json:
        _print_json(plan)
    else:
        _echo(render_import_plan(plan))


@main.command()
@click.argument("run", type=click.Path(path_type=str))
@json_option
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write diagnosis PNGs into this directory.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write one self-contained HTML report.")
@click.option("--rank", type=click.IntRange(0, None), default=None, help="Only this rank.")
@click.option("--steps", callback=parse_steps, default=None, metavar="A:B", help="Only steps A <= step < B.")
@fail_on_option("a finding of this severity or worse is present", "the report")
@_one_line_errors
def report(run, as_json, plots_dir, html_path, rank, steps, fail_on):
    """Diagnose a run's traces: a run directory, or a log from HF, Lightning, DeepSpeed, CSV/JSONL."""
    from .render import check_output_path, render_report_text, write_html, write_plots
    from .report import build_report

    if html_path:
        check_output_path(html_path, inputs=[run], option="--html")
    if plots_dir:
        check_output_path(plots_dir, inputs=[run], option="--plots", is_dir=True)
    rep = build_report(run, rank=rank, steps=steps, progress=sys.stderr.isatty() and not as_json,
                       plots=bool(plots_dir or html_path))
    plots = write_plots(rep, plots_dir) if plots_dir else []
    if html_path:
        write_html(rep, html_path)
    if as_json:
        _print_json(rep.to_dict())
    else:
        _echo(render_report_text(rep))
        for p in plots:
            _echo(f"plot: {p}")
        if html_path:
            _echo(f"html: {html_path}")
    status = rep.exit_status(fail_on)  # 3: a check raised (check_failed); 4: --fail-on matched
    if status:
        raise click.exceptions.Exit(status)


@main.command()
@click.argument("run", type=click.Path(path_type=str))
@checkpoint_options
@json_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write one self-contained HTML page, the answer first (links to snapshots are relative).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write the report's plots and each replay's figure into this directory.")
@click.option("--rank", type=click.IntRange(0, None), default=None, help="Only this rank.")
@device_option
@replay_options(culprit="each culprit", snapshot="the snapshots'")
@fail_on_option("the report has a finding of this severity or worse", "the autopsy")
@override_options
@_one_line_errors
def autopsy(run, batch, amp, accumulate, scale, as_json, html_path, out_dir, rank, device, ops, factory, loss_fn, paths, fail_on,
            rng, factory_kwargs):
    """One answer: report the run, replay its first failing snapshots, try each fix on them.

    RUN is a run directory, or with --batch a checkpoint (its own trainer_state.json, if any, is the report).
    """
    if under_torchrun():  # torchrun ... -m analyzer autopsy RUN: its first failing snapshot, on every rank
        from ._cli_distributed import distributed_command

        distributed_command(run, _print_json if as_json else None, device=device, factory=factory,
                            loss_fn=loss_fn, paths=paths, autopsy=True,
                            unsupported={"--batch": batch, "--rank": rank, "--html": html_path, "--out": out_dir,
                                         "--rng": rng, "--factory-kwargs": factory_kwargs, "--fail-on": fail_on})
        return
    from .autopsy import run_autopsy
    from .render import check_output_path, render_autopsy_text, write_autopsy_outputs

    if html_path:
        check_output_path(html_path, inputs=[run], option="--html")
    if out_dir:
        check_output_path(out_dir, inputs=[run], option="--out", is_dir=True)
    progress = sys.stderr.isatty() and not as_json
    if batch is not None and rank is not None:
        raise click.UsageError("--rank picks a run's snapshots, not a checkpoint with --batch")
    kwargs = _factory_kwargs(factory_kwargs)  # parsed once: a checkpoint's are applied when it is opened
    target = _open_target(run, "autopsy", batch, amp, scale, accumulate, factory=factory, loss_fn=loss_fn,
                          device=device, paths=paths, rng=rng, factory_kwargs=kwargs)
    result = run_autopsy(target.source, rank=rank, device=device, factory=factory, loss_fn=loss_fn, paths=paths,
                         progress=progress, on_stage=(lambda line: click.echo(line, err=True)) if progress else None,
                         factory_kwargs=kwargs if batch is None else None)
    written = write_autopsy_outputs(result, plots_dir=out_dir, replays_dir=out_dir, html=html_path,
                                    run_dir=target.run_dir)
    if as_json:
        _print_json(result.to_dict())
    else:
        _echo(render_autopsy_text(result, ops=ops))
        for p in written.figures:
            _echo(f"plot: {p}")
        if html_path:
            _echo(f"html: {html_path}")
    if result.failures:  # the report and the other replays are printed; the failure is the one Error line
        first = result.failures[0]
        more = f" (and {len(result.failures) - 1} more snapshot(s); see the answer)" if len(result.failures) > 1 else ""
        raise click.ClickException(_one_line(first.error + more))
    status = result.exit_status(fail_on)  # 3: a report check raised; 4: --fail-on matched
    if status:
        raise click.exceptions.Exit(status)


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=str))  # a file, or an HF checkpoint-N/ directory
@click.argument("checkpoint_b", required=False, type=click.Path(path_type=str))
@json_option
@click.option("--top", default=10, show_default=True, type=click.IntRange(1, None), help="Tensors to list per finding.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="cpu", show_default=True,
              help="Where to scan the tensors: cuda copies each chunk to the GPU (auto: cuda when present). "
                   "The results are the same.")
@click.option("--all-tensors", is_flag=True, help="With --json: list every tensor (by default the 500 worst of "
              "each file; tensors_total says how many there are).")
@fail_on_option("a finding of this severity or worse is present", "the output")
@_one_line_errors
def inspect(checkpoint, checkpoint_b, as_json, top, device, all_tensors, fail_on):
    """Check a checkpoint (or two) for NaN/Inf, FP16/BF16 range risk and optimizer-state damage."""
    from .inspect import inspect_checkpoints
    from .render import render_inspect_text

    result = inspect_checkpoints(checkpoint, checkpoint_b, progress=sys.stderr.isatty() and not as_json,
                                 device=device)
    if as_json:
        _print_json(result.to_dict(tensors=None) if all_tensors else result.to_dict())
    else:
        _echo(render_inspect_text(result, top=top))
    status = result.exit_status(fail_on)  # 4: --fail-on matched, as for report
    if status:
        raise click.exceptions.Exit(status)


@main.command("fp8-readiness")
@click.argument("snapshot", type=click.Path(path_type=str))
@checkpoint_options
@json_option
@device_option
@replay_options(culprit=None, snapshot="the snapshot's")
@_one_line_errors
def fp8_readiness(snapshot, batch, amp, accumulate, scale, as_json, device, factory, loss_fn, paths):
    """What FP8 training would flush or saturate in a BF16 step, per Linear and operand, and which to keep in BF16.

    SNAPSHOT is a recorder snapshot, or with --batch a checkpoint: the step is replayed once in its
    own precision and every Linear's input, weight and grad_output is cast, in statistics only, as
    torchao's tensorwise and rowwise recipes and MXFP8 would cast it.
    """
    from .render.fp8 import render_readiness_text
    from .replay import Replay
    from .replay.fp8.readiness import fp8_readiness as measure

    target = _open_target(snapshot, "replay", batch, amp, scale, accumulate, factory=factory, loss_fn=loss_fn,
                          device=device, paths=paths)
    result = measure(Replay(target.source, device=device, factory=factory, loss_fn=loss_fn, paths=paths).context())
    if as_json:
        _print_json(result.to_dict())
    else:
        _echo(render_readiness_text(result, source=snapshot))


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default="amp-autopsy-demo",
              show_default=True, help="Where to write the run, plots and report.")
@click.option("--scenario", default="fp16_attention_overflow", show_default=True,
              help="Which bundled failure to run (see samples/).")
@_one_line_errors
def demo(out_dir, scenario):
    """Run a bundled failing training run, then report and replay it, end to end."""
    from .demo import run_demo

    run_demo(out_dir, scenario=scenario, echo=_echo)


if __name__ == "__main__":
    main()
