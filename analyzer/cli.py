"""The ``analyzer`` command line: parses options, calls the library, renders. Nothing else.

Errors from ``analyzer.errors`` become one ``Error: ...`` line and exit status 1; click keeps
exit status 2 for usage errors.
"""
from __future__ import annotations

import functools
import json
import sys

import click

from .errors import AnalyzerError

__all__ = ["main"]


def _one_line_errors(fn):
    """Turn AnalyzerError (and a few OS errors) into a one-line message and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AnalyzerError as e:
            raise click.ClickException(str(e)) from e
        except (OSError, MemoryError) as e:
            raise click.ClickException(" ".join(f"{type(e).__name__}: {e}".split())) from e

    return wrapper


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, allow_nan=False, default=str))


def _parse_steps(ctx, param, value):
    if value is None:
        return None
    lo, sep, hi = value.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise click.BadParameter("expected A:B, A: or :B with integer steps, e.g. 100:500") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="amp-autopsy")
def main() -> None:
    """amp-autopsy: find out why a mixed-precision (FP16/BF16) training run went NaN."""


@main.command()
@click.argument("snapshot", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object to stdout.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where to replay: cuda when present (auto), else cpu.")
@click.option("--dtypes", default=None, metavar="LIST",
              help="Precisions to replay, e.g. fp32,fp16,bf16. Default: fp32 and the run's AMP dtype.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write a PNG of per-op abs-max along execution order.")
@click.option("--ops", default=8, show_default=True, type=click.IntRange(0, None),
              help="Ops to show around the culprit.")
@click.option("--factory", default=None, metavar="REF", help="Override the model factory, pkg.mod:function.")
@click.option("--loss-fn", "loss_fn", default=None, metavar="REF", help="Override the loss function, pkg.mod:function.")
@_one_line_errors
def replay(snapshot, as_json, device, dtypes, plot_path, ops, factory, loss_fn):
    """Re-run a failing step in FP32 and FP16/BF16 and name the first op that made NaN/Inf."""
    from .replay import plot_replay, render_replay_text, replay_snapshot

    dtype_list = None if dtypes is None else [d.strip() for d in dtypes.split(",") if d.strip()]
    result = replay_snapshot(snapshot, device=device, dtypes=dtype_list, factory=factory,
                             loss_fn=loss_fn, progress=sys.stderr.isatty() and not as_json)
    if plot_path:
        plot_replay(result, plot_path)
    if as_json:
        _print_json(result.to_dict())
    else:
        click.echo(render_replay_text(result, ops=ops))


@main.command()
@click.argument("run", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object to stdout.")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False, path_type=str), default=None,
              help="Write diagnosis PNGs into this directory.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Write one self-contained HTML report.")
@click.option("--rank", type=click.IntRange(0, None), default=None, help="Only this rank.")
@click.option("--steps", callback=_parse_steps, default=None, metavar="A:B", help="Only steps A <= step < B.")
@_one_line_errors
def report(run, as_json, plots_dir, html_path, rank, steps):
    """Diagnose a run's traces: a run directory, or a log from HF, Lightning, DeepSpeed, CSV/JSONL."""
    from .report import build_report, render_report_text, write_html, write_plots

    rep = build_report(run, rank=rank, steps=steps, progress=sys.stderr.isatty() and not as_json)
    plots = write_plots(rep, plots_dir) if plots_dir else []
    if html_path:
        write_html(rep, html_path)
    if as_json:
        _print_json(rep.to_dict())
    else:
        click.echo(render_report_text(rep))
        for p in plots:
            click.echo(f"plot: {p}")
        if html_path:
            click.echo(f"html: {html_path}")


@main.command()
@click.argument("checkpoint", type=click.Path(dir_okay=False, path_type=str))
@click.argument("checkpoint_b", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object to stdout.")
@click.option("--top", default=10, show_default=True, type=click.IntRange(1, None), help="Tensors to list per finding.")
@_one_line_errors
def inspect(checkpoint, checkpoint_b, as_json, top):
    """Check a checkpoint (or two) for NaN/Inf, FP16/BF16 range risk and optimizer-state damage."""
    from .inspect import inspect_checkpoints, render_inspect_text

    result = inspect_checkpoints(checkpoint, checkpoint_b, progress=sys.stderr.isatty() and not as_json)
    if as_json:
        _print_json(result.to_dict())
    else:
        click.echo(render_inspect_text(result, top=top))


@main.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=str), default="amp-autopsy-demo",
              show_default=True, help="Where to write the run, plots and report.")
@click.option("--scenario", default="fp16_attention_overflow", show_default=True,
              help="Which bundled failure to run (see samples/).")
@_one_line_errors
def demo(out_dir, scenario):
    """Run a bundled failing training run, then report and replay it, end to end."""
    from .demo import run_demo

    run_demo(out_dir, scenario=scenario, echo=click.echo)


if __name__ == "__main__":
    main()
