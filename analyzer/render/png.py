"""Figures as small PNGs for the pages: a palette PNG is a third of matplotlib's RGBA one.

A page a user attaches to a bug report must stay small: the autopsy page inlines every figure as
base64. Matplotlib writes 32-bit RGBA; a figure has a few dozen flat colours plus their
antialiased edges, so an adaptive 256-colour palette keeps it visually the same (the colour
maps are 256 colours themselves) at about a third of the bytes. PNG compression is lossless:
what is lost is only colour precision in the antialiased edges.

Example:
    >>> data = figure_png(fig, dpi=90)  # doctest: +SKIP
"""
from __future__ import annotations

import base64
import io

__all__ = ["figure_png", "figure_png_b64"]


def figure_png(fig, *, dpi: int) -> bytes:
    """`fig` as an 8-bit palette PNG at `dpi` (white background, no alpha)."""
    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    buf.seek(0)
    with Image.open(buf) as img:
        rgb = img.convert("RGB")
    # median cut, no dithering: dithering speckles flat areas and makes them compress worse
    pal = rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    pal.save(out, format="PNG", optimize=True)
    return out.getvalue()


def figure_png_b64(fig, *, dpi: int) -> str:
    """``figure_png`` as base64 text, for a ``data:image/png;base64,`` URL."""
    return base64.b64encode(figure_png(fig, dpi=dpi)).decode()
