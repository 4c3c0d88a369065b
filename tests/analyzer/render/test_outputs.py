"""analyzer.render.outputs: pages and plots are written atomically, with the mode open() would give."""
from __future__ import annotations

import os
import stat

import pytest

from analyzer.render.outputs import atomic_write_text


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_written_page_gets_the_mode_the_umask_gives_not_mkstemps_0600(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        out = atomic_write_text(tmp_path / "page.html", "<p>answer</p>")
    finally:
        os.umask(old)
    assert out.read_text() == "<p>answer</p>"
    assert stat.S_IMODE(out.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]  # no temporary file left behind
