"""Reading runs: version checks, damaged input, partial runs, and the foreign-log importers."""
from __future__ import annotations

import json
import math
import sys

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analyzer.errors import AnalyzerError, BadInputError, VersionError
from analyzer.report import build_report
from analyzer.load import load_run, read_meta
from analyzer.load.run_dir import _Known
from recorders import schema
from tests.extras import require

from ..report.report_models import Script


@pytest.fixture
def run_dir(tmp_path):
    return Script(n=120).write(tmp_path / "run", parts=3)


def test_a_run_dir_reads_lazily_with_schema_dtypes_and_param_names(run_dir):
    run = load_run(run_dir)
    assert isinstance(run.steps, pl.LazyFrame) and isinstance(run.layers, pl.LazyFrame)
    assert run.steps.collect_schema() == pl.Schema(schema.STEP_COLUMNS)
    assert run.layers.select(pl.len()).collect().item() == 120 * 8  # 120 steps x 8 params
    assert run.params[:2] == ["blocks.0.weight", "blocks.0.bias"] and run.numels[0] == 16
    assert run.growth_interval == 100 and run.amp_dtype == "float16" and not run.partial


def test_a_missing_directory_is_a_one_line_error_naming_it(tmp_path):
    with pytest.raises(BadInputError, match=r"nope: no such file or directory") as e:
        load_run(tmp_path / "nope")
    assert "\n" not in str(e.value)


def test_a_run_without_trace_parts_is_an_empty_trace(run_dir):
    for f in (run_dir / "trace").iterdir():
        f.unlink()
    with pytest.raises(BadInputError, match="empty trace"):
        load_run(run_dir)


def test_a_truncated_part_names_the_file_and_the_fix(run_dir):
    part = run_dir / "trace" / "layers-r00000-p000001.parquet"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    with pytest.raises(BadInputError, match=r"layers-r00000-p000001\.parquet: truncated or corrupt.*move the damaged"):
        load_run(run_dir)


def test_a_foreign_parquet_part_is_refused(run_dir):
    pl.DataFrame({"epoch": [1], "acc": [0.5]}).write_parquet(run_dir / "trace" / "steps-r00000-p000009.parquet")
    with pytest.raises(BadInputError, match=r"steps-r00000-p000009\.parquet: foreign Parquet part"):
        load_run(run_dir)


def test_unknown_columns_mean_a_newer_writer(run_dir):
    part = run_dir / "trace" / "steps-r00000-p000000.parquet"
    pl.read_parquet(part).with_columns(fp8_amax=pl.lit(1.0)).write_parquet(part)
    with pytest.raises(VersionError, match=r"unknown to format version \d+: \['fp8_amax'\].*pip install -U"):
        load_run(run_dir)


def test_a_newer_format_version_in_meta_is_refused(run_dir):
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["format_version"] = schema.FORMAT_VERSION + 1
    (run_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(VersionError, match=r"meta\.json: run format version \d+ is newer"):
        load_run(run_dir)


def test_a_damaged_meta_json_is_a_bad_input(run_dir):
    (run_dir / "meta.json").write_text('{"format": "amp-autop')
    with pytest.raises(BadInputError, match=r"meta\.json: not valid JSON"):
        load_run(run_dir)


def _ranks_run(root, ranks: int = 5, parts: int = 3):
    for r in range(ranks):
        Script(n=30, rank=r).write(root / "run", parts=parts, world_size=ranks)
    return root / "run"


def test_a_steps_part_copied_from_another_rank_among_many_is_named_at_load(tmp_path):
    run = _ranks_run(tmp_path)
    trace = run / schema.TRACE_DIR
    moved = trace / schema.part_name("steps", 3, 1)
    moved.write_bytes((trace / schema.part_name("steps", 1, 1)).read_bytes())  # rank 1's rows, rank 3's name
    with pytest.raises(BadInputError) as e:
        load_run(run)
    assert str(e.value).startswith(f"{moved}: steps parts named rank 3 hold rows of rank 1 (a part was renamed")


def test_parts_whose_rank_columns_differ_in_type_are_still_checked_one_by_one(tmp_path):
    run = _ranks_run(tmp_path)
    trace = run / schema.TRACE_DIR
    for p in range(3):  # rank 2 wrote Int64 ranks: the parts cannot be scanned together, so each is read alone
        part = trace / schema.part_name("steps", 2, p)
        pl.read_parquet(part).with_columns(pl.col("rank").cast(pl.Int64)).write_parquet(part)
    assert load_run(run).ranks == [0, 1, 2, 3, 4]
    wrong = trace / schema.part_name("steps", 4, 2)
    pl.read_parquet(wrong).with_columns(pl.lit(0, pl.Int64).alias("rank")).write_parquet(wrong)
    with pytest.raises(BadInputError, match=r"steps-r00004-p000002\.parquet: steps parts named rank 4 hold rows of rank 0"):
        load_run(run)


def test_a_steps_part_whose_rank_page_is_damaged_is_named_at_load(tmp_path):
    run = _ranks_run(tmp_path, ranks=3, parts=2)
    part = run / schema.TRACE_DIR / schema.part_name("steps", 1, 1)
    df = pl.read_parquet(part)
    df.select("rank", pl.exclude("rank")).write_parquet(part)  # rank first: its page header opens the file
    data = bytearray(part.read_bytes())
    for i in range(4, 40):  # that page header; the footer stays intact
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(BadInputError) as e:
        load_run(run)
    assert str(e.value).startswith(f"{part}: Parquet part's data is corrupt or out of range (")


_META = Script(n=4, rank=1).meta(world_size=2) | {
    "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": [0, 1]}]},
    "micro_batches": 1, "micro_batches_kept": True}
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                     max_leaves=8)


def _twins(v):
    """`v` with its numbers as other types that compare equal (1 -> 1.0, True; 1.0 -> 1; 0 -> -0.0)."""
    if isinstance(v, bool):
        return [int(v), float(v)]
    if isinstance(v, int):
        return [float(v)] + ([bool(v)] if v in (0, 1) else []) + ([-0.0] if v == 0 else [])
    if isinstance(v, float):
        return [int(v)] if v.is_integer() else []
    if isinstance(v, list):
        return [v[:i] + [t] + v[i + 1:] for i, x in enumerate(v) for t in _twins(x)][:4]
    if isinstance(v, dict):
        return [{**v, k: t} for k, x in v.items() for t in _twins(x)][:4]
    return []


@st.composite
def _rank_meta_edits(draw):
    key = draw(st.sampled_from(sorted(_META)))
    twins = _twins(_META[key])
    value = draw(st.sampled_from(twins) if twins and draw(st.booleans()) else _JSON)
    return key, value


def _outcome(read):
    try:
        return "read", repr(read())
    except AnalyzerError as e:
        return "refused", str(e)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edit=_rank_meta_edits())
def test_a_ranks_meta_read_beside_the_first_is_read_or_refused_exactly_as_alone(tmp_path, edit):
    # rank 0's meta.json is checked in full; a rank's values that repeat it are taken from it unchecked,
    # so any value a rank's meta may hold, numbers equal to rank 0's but of another type included,
    # must give what checking that meta alone gives
    first = tmp_path / schema.META_FILE
    first.write_text(json.dumps(_META | {"rank": 0}))
    key, value = edit
    rank1 = tmp_path / schema.meta_name(1)
    rank1.write_text(json.dumps(_META | {key: value}))
    like = _Known(read_meta(first))
    assert _outcome(lambda: read_meta(rank1, like)) == _outcome(lambda: read_meta(rank1))


def test_a_ranks_meta_repeating_the_first_shares_its_values_and_one_of_another_type_is_refused(tmp_path):
    first = tmp_path / schema.META_FILE
    first.write_text(json.dumps(_META | {"rank": 0}))
    like = _Known(read_meta(first))
    rank1 = tmp_path / schema.meta_name(1)
    rank1.write_text(json.dumps(_META))
    got = read_meta(rank1, like)
    assert got == _META and got["params"] is like.meta["params"] and got["rank"] == 1
    rank1.write_text(json.dumps(_META | {"world_size": 2.0}))  # equal to rank 0's 2, not an integer
    with pytest.raises(BadInputError, match=r"world_size 2\.0 is not an integer"):
        read_meta(rank1, like)


def test_a_killed_run_is_analysed_up_to_its_last_complete_part_and_says_so(run_dir):
    # the writer died while writing part 3: its temporary file is left behind, part 2 has no layers
    (run_dir / "trace" / ".steps-r00000-p000003.parquet.4242.tmp").write_bytes(b"PAR1\x00")
    (run_dir / "trace" / "layers-r00000-p000002.parquet").unlink()
    rep = build_report(run_dir)
    assert rep.partial and rep.to_dict()["partial"] is True
    assert any("partial run" in n and "temporary" in n for n in rep.notes)
    assert any("no layers part" in n for n in rep.notes)
    assert rep.steps_summary()["last"] == 119  # the complete step parts are all read
    assert int(rep.frames.layer_bins["step_hi"].max()) == 79  # layers end with part 1 (steps 0..79)


# --------------------------------------------------------------------------- importers
def test_hf_trainer_state_json_is_imported_with_hidden_nan_noted(tmp_path):
    trainer_callback = require("transformers.trainer_callback", "hf")
    history = [{"loss": 2.0 - 0.01 * i, "grad_norm": 1.0, "learning_rate": 5e-5, "epoch": i / 100, "step": 10 * i}
               for i in range(1, 40)]
    history[30]["grad_norm"] = float("nan")  # what logging_nan_inf_filter leaves of a NaN step
    history.append({"eval_loss": 1.9, "epoch": 0.39, "step": 390})
    history.append({"train_runtime": 12.0, "train_loss": 1.8, "epoch": 0.39, "step": 390})
    state = trainer_callback.TrainerState(global_step=390, log_history=history)
    path = tmp_path / "trainer_state.json"
    state.save_to_json(str(path))
    run = load_run(path)
    steps = run.steps.collect()
    assert run.source_format == "hf_trainer_state" and steps.height == 39  # eval/summary rows dropped
    assert steps["lr"][0] == 5e-5 and steps["step"][-1] == 390
    assert any("logging_nan_inf_filter" in n and "step 310" in n for n in run.notes)
    assert load_run(tmp_path).source_format == "hf_trainer_state"  # the output dir works too


def test_lightning_csvlogger_metrics_csv_is_imported(tmp_path):
    loggers = require("lightning.pytorch.loggers", "lightning")
    logger = loggers.CSVLogger(str(tmp_path), name="exp")
    for i in range(60):
        logger.log_metrics({"train_loss_step": 2.0 if i != 45 else float("nan"), "lr-Adam": 1e-3}, step=i)
    logger.log_metrics({"val_loss": 1.5, "epoch": 0}, step=59)
    logger.save()
    rep = build_report(tmp_path)
    assert rep.source_format == "lightning_csv" and rep.frames.steps.height == 60
    nf = [f for f in rep.findings if f.check == "nonfinite_loss"]
    assert nf and nf[0].step == 45 and "numerical fault" in nf[0].message
    # Lightning's own file (header rewritten for the late keys, blank cells) holds nothing malformed
    assert "implausible_trace" not in {f.check for f in rep.findings}


DEEPSPEED_LOG = """\
[2024-05-01 10:00:00,000] [INFO] [config.py:1000:print] fp16 enabled ....... True
[2024-05-01 10:00:01,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
[2024-05-01 10:00:01,100] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 1 Skipping step. Attempted loss scale: 65536, reducing to 32768
[2024-05-01 10:00:02,000] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 32768, reducing to 16384
steps: 10 loss: 2.3456 iter time (s): 0.120 samples/sec: 266.667
[2024-05-01 10:00:05,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=2, lr=[0.0001], mom=[(0.9, 0.999)]
steps: 20 loss: 2.1000 iter time (s): 0.120 samples/sec: 266.667
"""


def test_deepspeed_overflow_lines_become_skipped_steps_with_their_scale(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(DEEPSPEED_LOG)
    steps = load_run(path).steps.collect()
    # two rank-0 OVERFLOW lines: steps 1 and 2 (DeepSpeed counts skipped steps in global_steps)
    assert steps.filter(pl.col("skipped"))["step"].to_list() == [1, 2]
    assert steps.filter(pl.col("skipped"))["scale"].to_list() == [65536.0, 32768.0]
    assert steps.filter(pl.col("step") == 20)["scale"].item() == 16384.0  # the reduced scale holds
    assert steps.filter(pl.col("step") == 10)["loss"].item() == pytest.approx(2.3456)
    assert "implausible_trace" not in {f.check for f in build_report(path).findings}


def _megatron_line(it, loss, scale, skipped=0, nan=0):
    return (f" iteration {it:8d}/   50000 | consumed samples: {it * 512:12d} | elapsed time per iteration (ms): "
            f"1234.5 | learning rate: 1.500E-04 | global batch size:   512 | lm loss: {loss:.6E} | "
            f"loss scale: {scale:.1f} | grad norm: 1.234 | number of skipped iterations: {skipped:3d} | "
            f"number of nan iterations: {nan:3d} |")


def test_megatron_log_lines_give_loss_scale_and_nan_iterations(tmp_path):
    lines = [_megatron_line(100 * i, 7.0 - 0.01 * i, 65536.0 / 2 ** (i // 20)) for i in range(1, 80)]
    lines[60] = _megatron_line(6100, 6.5, 1.0, skipped=100, nan=3)
    path = tmp_path / "megatron.out"
    path.write_text("\n".join(["> building GPT model ..."] + lines))
    run = load_run(path)
    steps = run.steps.collect()
    assert run.source_format == "megatron_log" and steps.height == 79 and run.amp_dtype == "float16"
    row = steps.filter(pl.col("step") == 6100).row(0, named=True)
    assert math.isnan(row["loss"]) and row["n_skipped"] == 100 and row["n_iter"] == 100
    assert steps["grad_norm"][0] == pytest.approx(1.234) and steps["lr"][0] == pytest.approx(1.5e-4)
    assert "implausible_trace" not in {f.check for f in build_report(path).findings}


def test_generic_csv_and_jsonl_with_step_and_loss(tmp_path):
    (tmp_path / "log.csv").write_text("step,loss,loss_scale\n" + "".join(f"{i},{2 - i / 100},1024\n" for i in range(50)))
    (tmp_path / "log.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0, "grad_norm": 0.5}) + "\n"
                                                for i in range(50)))
    c = load_run(tmp_path / "log.csv").steps.collect()
    j = load_run(tmp_path / "log.jsonl").steps.collect()
    assert c.height == 50 and c["scale"][0] == 1024.0 and j["grad_norm"][0] == 0.5


@pytest.mark.parametrize("name,text,match", [
    ("no_step.csv", "loss\n1.0\n", "without a 'step' column"),
    ("bad.jsonl", '{"step": 1, "loss": 1}\n{oops\n', "line 2 is not JSON"),
    ("notes.txt", "hello world\n", "unrecognised file"),
    ("state.json", '{"foo": 1}', "not an HF trainer_state.json"),
], ids=["csv without step", "broken jsonl", "plain text", "json without log_history"])
def test_unreadable_logs_are_one_line_errors(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(BadInputError, match=match):
        load_run(tmp_path / name)


def test_tensorboard_event_dir_is_imported_when_the_extra_is_installed(tmp_path):
    require("tensorboard", "tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "tb"))  # real event files, written by torch's own writer
    for i in range(50):
        w.add_scalar("train/loss", float("nan") if i == 30 else 2.0 - 0.01 * i, i)
        w.add_scalar("train/grad_norm", 1.0, i)
        w.add_scalar("train/learning_rate", 1e-3, i)
    w.close()
    rep = build_report(tmp_path / "tb")
    assert rep.source_format == "tensorboard" and rep.frames.steps.height == 50
    assert rep.frames.steps["lr"][0] == pytest.approx(1e-3)
    assert [f.step for f in rep.findings if f.check == "nonfinite_loss"] == [30]


def test_tensorboard_without_the_extra_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"\x00")
    for name in ("tensorboard", "tensorboard.backend.event_processing.event_accumulator"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the extra were not installed
    with pytest.raises(BadInputError, match=r"amp-autopsy\[tensorboard\]"):
        load_run(tmp_path)
