"""Make file-provided text safe to print: control characters become visible escapes.

Parameter names, snapshot file names and reasons, checkpoint keys and error messages come from
files the user did not write. Printed raw, ``\\x1b[2J`` clears the screen and an OSC sequence
sets the window title; click strips them only when output is piped. Every line the CLI prints
goes through ``escape_controls`` (HTML output escapes with ``html.escape`` instead, and JSON
output escapes control characters by itself).

Example:
    >>> escape_controls("layer\\x1b[2J.weight")
    'layer\\\\x1b[2J.weight'
"""
from __future__ import annotations

import re

__all__ = ["escape_controls"]

# C0 controls except tab and newline, DEL, C1 controls, and the Unicode bidi overrides and
# isolates that reorder what a terminal shows ("Trojan Source").
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROLS_AND_NEWLINES = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(m: re.Match) -> str:
    c = m.group(0)
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_controls(text: str, *, keep_newlines: bool = True) -> str:
    """Return `text` with every control character written as ``\\xNN`` / ``\\uNNNN``.

    Args:
        text: what is about to be printed.
        keep_newlines: leave ``\\n`` and ``\\t`` as they are (multi-line reports); False for
            one-line messages, where a newline in a file name would break the one-line rule.
    """
    pattern = _CONTROLS if keep_newlines else _CONTROLS_AND_NEWLINES
    return pattern.sub(_visible, str(text))
