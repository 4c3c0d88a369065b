"""``analyzer report`` on scripted runs: CLI, JSON, text, plots, HTML, ranks, bad input."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from analyzer.cli import main
from analyzer.render import render_report_text
from analyzer.report import build_report

from .report_models import Script


def _two_ranks(tmp_path, *, nan_rank=1, nan_step=100, diverge_scale=False, short_rank=None):
    """A 2-rank DDP-like run: `nan_rank`'s local loss is NaN at `nan_step`, the other's one step later."""
    run = tmp_path / "ddp"
    for r in (0, 1):
        n = 150 if short_rank == r else 200
        s = Script(n=n, rank=r)
        s.scale[:], s.skipped[:] = Script(n=n).scale, Script(n=n).skipped  # one synchronised scaler
        if nan_rank is not None:
            s.loss[nan_step if r == nan_rank else nan_step + 1:] = np.nan
        if diverge_scale and r == 1:
            s.scale[150:] /= 2
        s.write(run, world_size=2)
    return run


def _hashes(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_cli_json_is_one_strict_json_object_with_stable_keys(tmp_path):
    s = Script()
    s.loss[250:] = np.nan
    run = s.write(tmp_path / "run")
    res = CliRunner().invoke(main, ["report", str(run), "--json"])
    assert res.exit_code == 0, res.output

    def refuse(const):  # json.loads accepts NaN/Infinity literals by default; strict JSON has none
        raise AssertionError(f"non-strict JSON literal {const}")

    obj = json.loads(res.stdout, parse_constant=refuse)
    assert {"run", "steps", "findings", "snapshots", "ranks", "verdict", "partial"} <= set(obj)
    assert obj["steps"]["count"] == 400 and obj["steps"]["nonfinite_loss"] == 150
    nf = next(f for f in obj["findings"] if f["check"] == "nonfinite_loss")
    assert nf["step"] == 250 and nf["severity"] == "error" and nf["evidence"]["loss"] == "nan"


def test_text_starts_with_a_verdict_then_findings_by_severity(tmp_path):
    s = Script()
    s.loss_dtype[:] = "float16"
    s.loss[300] = np.inf
    rep = build_report(s.write(tmp_path / "run"))
    text = render_report_text(rep)
    lines = text.splitlines()
    assert lines[1].startswith("Verdict: FAILED: the loss became inf at step 300")
    assert text.index("\nerrors\n") < text.index("\nwarnings\n")
    assert "low_precision_loss @ step 0" in text and "evidence: loss_dtype=float16" in text


def test_healthy_text_says_healthy(tmp_path):
    rep = build_report(Script().write(tmp_path / "run"))
    assert render_report_text(rep).splitlines()[1] == "Verdict: healthy: no errors or warnings over 400 steps"


def test_report_never_modifies_its_input(tmp_path):
    s = Script()
    s.loss[200] = np.nan
    run = s.write(tmp_path / "run")
    snap = run / "snapshots" / "step00000200-r00000-nonfinite_loss.pt"
    snap.parent.mkdir()
    snap.write_bytes(b"snapshot bytes")
    (run / "trace" / ".steps-r00000-p000002.parquet.1.tmp").write_bytes(b"partial")
    before = _hashes(run)
    res = CliRunner().invoke(main, ["report", str(run), "--plots", str(tmp_path / "p"),
                                    "--html", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert _hashes(run) == before


def test_rank_divergence_names_the_rank_that_went_nonfinite_first(tmp_path):
    rep = build_report(_two_ranks(tmp_path))
    f = next(f for f in rep.findings if f.check == "rank_divergence")
    assert (f.severity, f.step, f.rank) == ("error", 100, 1)
    assert f.evidence["first_nonfinite_step_per_rank"] == {0: 101, 1: 100}
    nf = next(f for f in rep.findings if f.check == "nonfinite_loss")
    assert nf.step == 100 and nf.rank == 1 and "on rank 1" in nf.message
    assert "rank 1: steps 0..199" in render_report_text(rep)


def test_loss_scale_divergence_across_ranks_is_an_error(tmp_path):
    rep = build_report(_two_ranks(tmp_path, nan_rank=None, diverge_scale=True))
    f = [f for f in rep.findings if f.check == "rank_divergence"]
    assert len(f) == 1 and f[0].step == 150 and "not synchronised" in f[0].message
    assert f[0].evidence["max_scale"] == 2 * f[0].evidence["min_scale"]


def test_a_rank_whose_trace_ends_early_is_a_warning(tmp_path):
    rep = build_report(_two_ranks(tmp_path, nan_rank=None, short_rank=1))
    f = [f for f in rep.findings if f.check == "rank_divergence"]
    assert [(x.severity, x.rank, x.step) for x in f] == [("warning", 1, 149)]


def test_healthy_two_rank_run_has_no_rank_divergence(tmp_path):
    rep = build_report(_two_ranks(tmp_path, nan_rank=None))
    assert not [f for f in rep.findings if f.severity in ("error", "warning")]
    assert rep.frames.n_ranks == 2


def test_cli_rank_narrows_the_report_to_one_rank(tmp_path):
    run = _two_ranks(tmp_path)
    res = CliRunner().invoke(main, ["report", str(run), "--json", "--rank", "0"])
    obj = json.loads(res.stdout)
    assert obj["rank"] == 0 and not [f for f in obj["findings"] if f["check"] == "rank_divergence"]
    nf = next(f for f in obj["findings"] if f["check"] == "nonfinite_loss")
    assert nf["step"] == 101 and nf["rank"] == 0  # rank 0's own loss went NaN one step later


def test_cli_steps_window_limits_the_analysis(tmp_path):
    s = Script()
    s.loss[300] = np.nan
    run = s.write(tmp_path / "run")
    obj = json.loads(CliRunner().invoke(main, ["report", str(run), "--json", "--steps", "100:300"]).stdout)
    assert (obj["steps"]["first"], obj["steps"]["last"], obj["steps"]["count"]) == (100, 299, 200)
    assert not obj["findings"]  # the NaN at step 300 is outside A <= step < B


@pytest.mark.parametrize("args,needle", [
    (["--rank", "5"], "no rank 5 in this run"),
    (["--steps", "5000:6000"], "no steps of the run in the range"),
], ids=["unknown rank", "empty step window"])
def test_cli_selections_that_match_nothing_are_one_line_errors(tmp_path, args, needle):
    run = Script(n=50).write(tmp_path / "run")
    res = CliRunner().invoke(main, ["report", str(run), *args])
    assert res.exit_code == 1 and needle in res.output and len(res.output.strip().splitlines()) == 1


def _truncate(run):
    p = run / "trace" / "steps-r00000-p000001.parquet"
    p.write_bytes(p.read_bytes()[:100])


def _newer(run):
    m = json.loads((run / "meta.json").read_text())
    m["format_version"] = 99
    (run / "meta.json").write_text(json.dumps(m))


def _empty(run):
    for p in (run / "trace").iterdir():
        p.unlink()


@pytest.mark.parametrize("damage,needle", [
    (None, "no such file or directory"),
    (_truncate, "steps-r00000-p000001.parquet: truncated or corrupt Parquet part"),
    (_newer, "meta.json: run format version 99 is newer"),
    (_empty, "empty trace"),
], ids=["missing dir", "truncated part", "newer format", "empty trace"])
def test_cli_bad_input_exits_1_with_one_line_naming_the_file(tmp_path, damage, needle):
    run = Script(n=50).write(tmp_path / "run")
    target = tmp_path / "missing" if damage is None else run
    if damage:
        damage(run)
    res = CliRunner().invoke(main, ["report", str(target)])
    assert res.exit_code == 1
    assert res.output.startswith("Error: ") and needle in res.output
    assert len(res.output.strip().splitlines()) == 1


def _corrupt_first_page(part):
    data = bytearray(part.read_bytes())
    for i in range(4, 40):  # the first data page header: the footer stays intact
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))


def test_a_corrupt_layers_page_is_found_by_the_query_and_named_in_one_error_line(tmp_path):
    run = Script(n=50).write(tmp_path / "run", parts=2)
    part = run / "trace" / "layers-r00000-p000001.parquet"
    _corrupt_first_page(part)
    from analyzer.load import load_run

    assert load_run(run).layers is not None  # load reads footers only: the page is not read yet
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("Error: ") and "layers-r00000-p000001.parquet: Parquet part's data is corrupt" \
        in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("kind,column", [("steps", "step"), ("layers", "layer"), ("layers", "rank")])
def test_a_null_key_in_a_part_is_named_in_one_error_line(tmp_path, kind, column):
    run = Script(n=50).write(tmp_path / "run", parts=2)
    part = run / "trace" / f"{kind}-r00000-p000001.parquet"
    df = pl.read_parquet(part)
    df.with_columns(pl.when(pl.int_range(pl.len()) == 3).then(None).otherwise(pl.col(column)).alias(column)) \
        .write_parquet(part)
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 1, res.output
    assert f"{kind}-r00000-p000001.parquet: Parquet part has null values in its key column(s) ['{column}']" \
        in res.output and len(res.output.strip().splitlines()) == 1


def test_progress_goes_to_stderr(tmp_path, capsys):
    build_report(Script(n=50).write(tmp_path / "run"), progress=True)
    err = capsys.readouterr().err
    assert "checking 4 trace parts" in err and "aggregating per-layer gradient norms" in err


def test_a_reused_run_directory_uses_the_latest_row_of_each_step_and_says_so(tmp_path):
    run = Script(n=100).write(tmp_path / "run")
    again = Script(n=100, seed=5)
    again.loss[60] = np.nan
    steps = again.steps_frame()
    steps.write_parquet(run / "trace" / "steps-r00000-p000007.parquet")  # a second run's part, written later
    rep = build_report(run)
    assert rep.frames.steps.height == 100  # 200 rows, 100 distinct steps
    assert any("repeat a step number" in n for n in rep.notes)
    assert [f.step for f in rep.findings if f.check == "nonfinite_loss"] == [60]  # the latest run's NaN


def _nan_loss_run(tmp_path):
    s = Script()
    s.lg[:, 4:6] = -14  # stalled_layers: a warning
    s.loss[300] = np.nan  # nonfinite_loss: an error
    return s.write(tmp_path / "run")


def _boom(frames):
    raise ZeroDivisionError("a bug in a check")


def test_a_check_that_raises_becomes_check_failed_and_the_others_still_report(tmp_path, monkeypatch):
    from analyzer.report.checks import CHECKS

    monkeypatch.setitem(CHECKS, "boom", _boom)  # a real registered check, run by run_checks
    run = _nan_loss_run(tmp_path)
    res = CliRunner().invoke(main, ["report", str(run), "--json"])
    assert res.exit_code == 3, res.output  # an internal error: the report is incomplete
    obj = json.loads(res.stdout)
    failed = [f for f in obj["findings"] if f["check"] == "check_failed"]
    assert len(failed) == 1 and failed[0]["severity"] == "error"
    assert "'boom'" in failed[0]["message"] and "please report it" in failed[0]["message"]
    assert failed[0]["evidence"] == {"check": "boom", "error_type": "ZeroDivisionError", "error": "a bug in a check"}
    assert {"nonfinite_loss", "stalled_layers"} <= {f["check"] for f in obj["findings"]}
    assert obj["verdict"].startswith("FAILED: the loss became nan at step 300")  # a real error comes first
    text = CliRunner().invoke(main, ["report", str(run)])
    assert text.exit_code == 3 and "check_failed: the check 'boom' failed" in text.output


def test_a_check_that_raises_on_a_clean_run_makes_the_verdict_incomplete_not_healthy(tmp_path, monkeypatch):
    from analyzer.report.checks import CHECKS

    monkeypatch.setitem(CHECKS, "boom", _boom)
    rep = build_report(Script(n=60).write(tmp_path / "run"))
    assert rep.verdict.startswith("INCOMPLETE: 1 check(s) failed (boom") and rep.exit_status() == 3


@pytest.mark.parametrize("fail_on,status", [(None, 0), ("error", 4), ("warning", 4)])
def test_fail_on_exits_4_when_a_finding_that_severe_is_present(tmp_path, fail_on, status):
    run = _nan_loss_run(tmp_path)
    args = ["report", str(run)] + (["--fail-on", fail_on] if fail_on else [])
    res = CliRunner().invoke(main, args)
    assert res.exit_code == status, res.output
    assert res.output.splitlines()[1].startswith("Verdict: FAILED")  # the report is printed either way


def test_fail_on_error_passes_a_run_with_only_warnings_and_fail_on_warning_does_not(tmp_path):
    s = Script()
    s.lg[:, 4:6] = -14  # stalled_layers only: a warning, no error
    run = s.write(tmp_path / "run")
    assert CliRunner().invoke(main, ["report", str(run), "--fail-on", "error"]).exit_code == 0
    assert CliRunner().invoke(main, ["report", str(run), "--json", "--fail-on", "warning"]).exit_code == 4


def test_fail_on_passes_a_healthy_run(tmp_path):
    run = Script(n=60).write(tmp_path / "run")
    assert CliRunner().invoke(main, ["report", str(run), "--fail-on", "warning"]).exit_code == 0


def test_an_all_null_trace_says_no_usable_values_not_healthy(tmp_path):
    from recorders import schema
    from recorders.trace import TraceWriter

    from .report_models import make_meta

    run = tmp_path / "run"
    run.mkdir()
    params = [{"name": "w", "shape": [4], "numel": 4, "dtype": "float32", "depth": 0}]
    (run / "meta.json").write_text(json.dumps(make_meta(0, 1, "bfloat16", None, params)))
    rows = [{"step": i, "rank": 0, **{c: None for c in schema.STEP_COLUMNS if c not in ("step", "rank")}}
            for i in range(20)]
    layers = pl.DataFrame({"step": list(range(20)), "rank": [0] * 20, "layer": [0] * 20},
                          schema={c: schema.LAYER_COLUMNS[c] for c in ("step", "rank", "layer")})
    layers = layers.with_columns(*[pl.lit(None, dtype=t).alias(c) for c, t in schema.LAYER_COLUMNS.items()
                                   if c not in layers.columns]).select(list(schema.LAYER_COLUMNS))
    TraceWriter(run, 0).write(rows, layers)
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 0, res.output
    verdict = res.output.splitlines()[1]
    assert verdict.startswith("Verdict: no usable values") and "healthy" not in verdict.replace("known to be healthy", "")
    obj = json.loads(CliRunner().invoke(main, ["report", str(run), "--json"]).stdout)
    assert obj["steps"]["usable_values"] == {"loss": 0, "grad_norm": 0, "scale": 0, "layer_grad_norm": 0}


def test_zero_row_parts_do_not_blame_a_steps_range_that_was_never_passed(tmp_path):
    run = Script(n=50).write(tmp_path / "run")
    for p in (run / "trace").iterdir():
        pl.read_parquet(p).clear().write_parquet(p)  # the parts stay, with their schema and no rows
    res = CliRunner().invoke(main, ["report", str(run)])
    assert res.exit_code == 1 and res.output.startswith("Error: ")
    assert "--steps" not in res.output and "None" not in res.output


def test_with_rank_a_nan_gradient_averaged_in_from_another_rank_names_that_rank(tmp_path):
    run = tmp_path / "ddp"
    for r in (0, 1):
        s = Script(n=200, rank=r, amp_dtype="bfloat16")
        s.nonfinite = np.zeros(200, np.int64)
        s.nonfinite[100:] = 5  # DDP averages rank 1's NaN gradients into rank 0's at step 100
        s.layer_nonfinite[100:, :] = 1
        s.loss[100 if r == 1 else 101:] = np.nan  # rank 1's own batch; rank 0 one step later
        s.write(run, world_size=2)
    f = next(f for f in build_report(run, rank=0).findings if f.check == "nonfinite_grads")
    assert f.step == 100 and f.evidence["peer_nonfinite_loss"] == {1: 100}
    assert "rank 1's loss went non-finite at step 100" in f.message
    # all ranks merged: the loss is NaN at step 100 already, so nonfinite_loss says it, not this check
    assert not [f for f in build_report(run).findings if f.check == "nonfinite_grads"]


def test_a_report_without_plots_leaves_out_only_the_heatmap_cells_and_says_the_same(tmp_path):
    s = Script()
    s.lg[200:, 3] = np.inf  # one parameter's gradient norm overflows from step 200 on
    s.lg[220, 5] = np.nan
    s.pnorm[250:, 1] = np.nan  # another's weights go NaN at step 250
    s.loss[260:] = np.nan
    run = s.write(tmp_path / "run")
    full, lean = build_report(run), build_report(run, plots=False)
    assert lean.to_dict() == full.to_dict()  # the JSON (findings, evidence, summary) does not depend on plots
    assert [f.check for f in lean.findings] == [f.check for f in full.findings] and lean.findings
    assert lean.frames.layer_bins.equals(full.frames.layer_bins.drop("n_bad"))
    # the heatmap's red cells: 200 steps of layer 3 and step 220 of layer 5 (one step per bin up to 2000 steps)
    bad = full.frames.layer_bins.filter(pl.col("n_bad") > 0)
    assert int(bad["n_bad"].sum()) == 201 and set(bad["layer"].to_list()) == {3, 5}


def _red_pixels(png) -> int:
    import matplotlib.image as mpimg

    from analyzer.render.heatmap import NONFINITE_COLOR

    rgb = mpimg.imread(png)[..., :3]
    want = np.array([int(NONFINITE_COLOR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(rgb - want).max(axis=-1) < 0.02).sum())


def test_cli_plots_still_draw_the_nonfinite_heatmap_cells_and_the_json_is_the_same_without_them(tmp_path):
    s = Script()
    s.lg[200:, 3] = np.inf
    bad, clean = s.write(tmp_path / "bad"), Script().write(tmp_path / "clean")
    as_json = CliRunner().invoke(main, ["report", str(bad), "--json"])
    with_plots = CliRunner().invoke(main, ["report", str(bad), "--json", "--plots", str(tmp_path / "p")])
    assert CliRunner().invoke(main, ["report", str(clean), "--plots", str(tmp_path / "q")]).exit_code == 0
    assert as_json.exit_code == with_plots.exit_code == 0, as_json.output + with_plots.output
    assert json.loads(as_json.stdout) == json.loads(with_plots.stdout)
    # the overflowing parameter's row is red over half the steps; the clean run has red in its colour bar only
    assert _red_pixels(tmp_path / "p" / "grad_heatmap.png") > _red_pixels(tmp_path / "q" / "grad_heatmap.png") + 500


def test_a_rank_whose_parts_hold_its_steps_out_of_order_gets_a_sorted_step_table_and_the_same_report(tmp_path):
    s = Script()
    s.loss[300:] = np.nan
    ordered = s.write(tmp_path / "ordered")
    swapped = s.write(tmp_path / "swapped")
    trace = swapped / "trace"
    for kind in ("steps", "layers"):  # part 0 holds steps 200..399, part 1 steps 0..199
        p0, p1 = trace / f"{kind}-r00000-p000000.parquet", trace / f"{kind}-r00000-p000001.parquet"
        p0.rename(trace / "tmp.parquet")
        p1.rename(p0)
        (trace / "tmp.parquet").rename(p1)
    rep, ref = build_report(swapped), build_report(ordered)
    assert rep.frames.steps["step"].to_list() == list(range(400))
    assert rep.frames.steps.equals(ref.frames.steps)
    assert [f.to_dict() for f in rep.findings] == [f.to_dict() for f in ref.findings] and rep.findings
