"""``analyzer.render`` for a report: the PNG plots and the self-contained HTML page, from scripted runs."""
from __future__ import annotations

import json
import math

import numpy as np

from analyzer.render import write_html, write_plots
from analyzer.report import build_report

from ..report.report_models import Script


def test_plots_are_four_readable_pngs_and_html_embeds_them(tmp_path):
    import matplotlib.image as mpimg

    s = Script()
    s.lg[:, 4:6] = -14
    s.loss[350:] = np.nan
    rep = build_report(s.write(tmp_path / "run"))
    paths = write_plots(rep, tmp_path / "plots")
    assert [p.name for p in paths] == ["loss_scale.png", "grad_heatmap.png", "stalled_fraction.png",
                                       "grad_vs_depth.png"]
    for p in paths:
        img = mpimg.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 800 and img.std() > 0.01  # a real picture
    page = write_html(rep, tmp_path / "r.html").read_text()
    assert page.count("src='data:image/png;base64,") == 4 and "http" not in page
    assert "nonfinite_loss" in page and "stalled_layers" in page


def test_imported_log_reports_without_layer_plots(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 2.0 if i != 30 else math.inf, "loss_scale": 1024})
                            + "\n" for i in range(60)))
    rep = build_report(path)
    assert rep.source_format == "jsonl" and [p.name for p in write_plots(rep, tmp_path / "p")] == ["loss_scale.png"]
    assert any("no per-layer gradient norms" in n for n in rep.notes)


def test_html_snapshot_links_are_relative_and_still_resolve_after_moving_page_and_run(tmp_path, fp16_attention_step):
    import re
    import shutil
    from pathlib import Path

    from ..conftest import copy_run

    # a real recorded failure: an FP16 attention step whose logits overflow (test_replay.py); a copy
    # of the session's shared run, since this test moves it
    copy_run(fp16_attention_step.parents[1], tmp_path / "work" / "run")
    snap = tmp_path / "work" / "run" / "snapshots" / fp16_attention_step.name
    rep = build_report(tmp_path / "work" / "run")
    page = write_html(rep, tmp_path / "work" / "pages" / "r.html").read_text()
    hrefs = re.findall(r"<a href='([^']*)'", page)
    assert hrefs == [f"../run/snapshots/{snap.name}"] and "file:" not in page
    shutil.move(tmp_path / "work", tmp_path / "moved")  # the page and the run, moved together
    assert (tmp_path / "moved" / "pages" / Path(hrefs[0])).resolve().is_file()
