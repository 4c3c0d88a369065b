"""The command line's one rule for failures: every one becomes one ``Error:`` line, with its exit status.

AnalyzerError and OS errors exit 1; anything else is an internal error, exit 3, naming the file and the
stage (``cli``'s docstring lists the statuses). Warnings raised while a command runs are held back,
dropped if it fails and printed once each after its output otherwise.
"""
from __future__ import annotations

import functools
import sys
import traceback
import warnings

import click

from ._terminal import escape_controls
from .errors import AnalyzerError

__all__ = ["EXIT_INTERNAL", "one_line", "one_line_errors"]

EXIT_INTERNAL = 3

# what each command was doing, for the internal-error line; the first argument names the file
_STAGES = {"replay": "replaying", "report": "reporting", "inspect": "inspecting", "demo": "running the demo",
           "autopsy": "running the autopsy", "fp8_readiness": "measuring FP8 readiness"}
_FILE_ARGS = ("snapshot", "run", "checkpoint", "out_dir")


class _InternalError(click.ClickException):
    """An exception no loader anticipated: still one line, with its own exit status."""

    exit_code = EXIT_INTERNAL


def one_line(text: str) -> str:
    return " ".join(escape_controls(text, keep_newlines=False).split())


def _internal_message(fn_name: str, kwargs: dict, e: BaseException) -> str:
    target = next((kwargs[k] for k in _FILE_ARGS if kwargs.get(k) is not None), None)
    stage = _STAGES.get(fn_name, f"running {fn_name}")
    detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    where = f"{target}: " if target is not None else ""
    return one_line(f"{where}internal error while {stage}: {type(e).__name__}: {detail} "
                     "(please report this with the file; --debug shows the traceback)")


def one_line_errors(fn):
    """Every failure becomes one ``Error:`` line: AnalyzerError/OSError exit 1, anything else exit 3.

    Warnings are recorded, not printed, so nothing comes before the ``Error:`` line; after a
    successful command they are printed once each, escaped, after the output.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
        with warnings.catch_warnings(record=True) as caught:  # the filters in force still apply
            try:
                result = fn(*args, **kwargs)
            except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
                raise
            except AnalyzerError as e:
                if debug:
                    traceback.print_exc(file=sys.stderr)
                raise click.ClickException(one_line(str(e))) from e
            except (OSError, MemoryError) as e:
                if debug:
                    traceback.print_exc(file=sys.stderr)
                raise click.ClickException(one_line(f"{type(e).__name__}: {e}")) from e
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as e:  # noqa: BLE001 - the last line of defence; polars panics are BaseException
                if debug:
                    traceback.print_exc(file=sys.stderr)
                raise _InternalError(_internal_message(fn.__name__, kwargs, e)) from e
        seen = set()
        for w in caught:
            line = one_line(f"warning: {w.category.__name__}: {w.message}")
            if line not in seen:
                seen.add(line)
                click.echo(line, err=True)
        return result

    return wrapper
