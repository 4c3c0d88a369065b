"""Generate hostile and broken inputs for every reader, for tests/test_hostile_inputs.py.

Nothing here is committed as a binary: each case writes its files into a fresh directory. A case
is ``(name, build)`` where ``build(dir) -> list[str]`` writes the input and returns the analyzer
arguments that read it (``["report", RUN]``, ``["replay", SNAP]``, ``["inspect", CKPT]``).

The classes: unvalidated values (ranks, shapes, steps, scaler state,
RNG), deep nesting, encoding and CSV errors, Parquet parts with wrong types or corrupt pages,
safetensors headers with impossible shapes, memory bombs, and escape sequences in names.
"""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Callable

import polars as pl
import torch

from recorders import schema
from recorders.snapshot import build_snapshot, write_snapshot

from .analyzer.report.report_models import Script, make_meta

__all__ = ["CASES", "ESC", "snapshot_dict", "snapshot_case", "deep_pickle", "rezip", "zip_bomb", "run_dir"]

ESC = "\x1b[2J\x1b]0;pwned\x07"  # clear screen + set the window title (OSC)
_REF = "tests.analyzer.replay.replay_models"


def snapshot_dict(**overrides) -> dict:
    """A real snapshot of a tiny model, with fields overridden."""
    model = torch.nn.Linear(3, 2)
    snap = build_snapshot(step=3, reason="nonfinite_loss", model=model,
                          batch={"x": torch.randn(2, 3), "y": torch.randn(2, 2)},
                          rng={"cpu": torch.get_rng_state(), "cuda": None},
                          factory=f"{_REF}:build_eps_net", factory_kwargs={}, loss_fn=f"{_REF}:mse",
                          amp_dtype=torch.float16, device_type="cpu")
    snap.update(overrides)
    return snap


def snapshot_case(**overrides) -> Callable[[Path], list[str]]:
    def build(d: Path) -> list[str]:
        return ["replay", str(write_snapshot(d / "snap.pt", snapshot_dict(**overrides)))]
    return build


def rezip(src: Path, dst: Path, replace: dict[str, bytes], compression=zipfile.ZIP_STORED) -> Path:
    """Copy a torch.save zip, replacing records (by name after the archive folder)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression=compression) as zout:
        for info in zin.infolist():
            tail = info.filename.split("/", 1)[1]
            zout.writestr(info.filename, replace.get(tail, zin.read(info)))
    return dst


def deep_pickle(depth: int) -> bytes:
    """A pickle of a list nested `depth` deep, built from opcodes (pickle.dumps would recurse)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _deep_torch(d: Path, name: str) -> Path:
    torch.save({"x": torch.zeros(2)}, d / "ok.pt")
    return rezip(d / "ok.pt", d / name, {"data.pkl": deep_pickle(100_000)})


def zip_bomb(d: Path, name: str, numel: int) -> Path:
    """A real torch.save file re-zipped with deflate: `numel` zero floats in a few hundred KiB."""
    torch.save({"w": torch.zeros(numel)}, d / "plain.pt")
    out = rezip(d / "plain.pt", d / name, {}, compression=zipfile.ZIP_DEFLATED)
    (d / "plain.pt").unlink()
    return out


def run_dir(d: Path, *, meta: dict | None = None, steps: pl.DataFrame | None = None, parts: int = 1) -> Path:
    """A real run directory (Script's trace), with meta.json or the first steps part replaced."""
    run = Script(n=20).write(d / "run", parts=parts)
    if meta is not None:
        (run / schema.META_FILE).write_text(json.dumps(meta))
    if steps is not None:
        steps.write_parquet(run / schema.TRACE_DIR / schema.part_name("steps", 0, 0))
    return run


def _meta(**overrides) -> dict:
    params = [{"name": f"p{i}", "shape": [4], "numel": 4} for i in range(8)]
    m = make_meta(0, 1, "float16", {"growth_interval": 100}, params)
    m.update(overrides)
    return m


def _meta_case(**overrides):
    return lambda d: ["report", str(run_dir(d, meta=_meta(**overrides)))]


def _meta_text(text: bytes):
    def build(d):
        run = run_dir(d)
        (run / schema.META_FILE).write_bytes(text)
        return ["report", str(run)]
    return build


def _bad_steps(df_fn):
    def build(d):
        return ["report", str(run_dir(d, steps=df_fn()))]
    return build


def _corrupt_page(d: Path) -> list[str]:
    run = run_dir(d)
    part = run / schema.TRACE_DIR / schema.part_name("steps", 0, 0)
    data = bytearray(part.read_bytes())
    for i in range(4, 40):  # the first data page header: the footer stays intact
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))
    return ["report", str(run)]


def _panicking_part(d: Path) -> list[str]:
    """Two bytes changed in a steps part: polars 1.x's streaming decoder panics on it (a Rust
    assertion, printed to fd 2 with a backtrace) instead of raising an error."""
    run = run_dir(d)
    part = run / schema.TRACE_DIR / schema.part_name("steps", 0, 0)
    data = bytearray(part.read_bytes())
    data[911], data[2323] = 154, 92
    part.write_bytes(bytes(data))
    return ["report", str(run)]


def _file(name: str, content: bytes | str):
    def build(d):
        p = d / name
        p.write_bytes(content.encode() if isinstance(content, str) else content)
        return ["report", str(p)]
    return build


def _safetensors(header: dict | bytes, data: bytes = b"\0" * 16):
    def build(d):
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        p = d / "model.safetensors"
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return ["inspect", str(p)]
    return build


def _torch_file(name: str, builder):
    def build(d):
        return ["inspect", str(builder(d, name))]
    return build


def _stride0_checkpoint(d: Path, name: str) -> Path:
    torch.save({"w": torch.zeros(1).expand(3_000_000_000)}, d / name)  # 12 GB if materialised
    return d / name


def _unaligned_checkpoint(d: Path, name: str) -> Path:
    torch.save({"w": torch.randn(1000), "b": torch.randn(3)}, d / "aligned.pt")
    out = rezip(d / "aligned.pt", d / name, {})  # Python's zipfile does not pad records to 64 bytes
    (d / "aligned.pt").unlink()
    return out


def _bad_param_groups(d: Path, name: str) -> Path:
    opt = {"state": {0: {"step": "x", "exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": "x", "params": ["a", 1e300]}]}
    torch.save({"model": {"w": torch.randn(4)}, "optimizer": opt}, d / name)
    return d / name


def _bad_zip_name(d: Path, name: str) -> Path:
    """A torch.save file whose member name claims UTF-8 (flag 0x800) but is not: zipfile raises
    UnicodeDecodeError opening it."""
    torch.save({"w": torch.zeros(2)}, d / "ok.pt")
    with zipfile.ZipFile(d / "ok.pt") as zin, zipfile.ZipFile(d / "named.pt", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename.replace("version", "versi\u00e9n"), zin.read(info))
    raw = (d / "named.pt").read_bytes().replace("\u00e9".encode(), b"\xe9A")
    (d / name).write_bytes(raw)
    for tmp in ("ok.pt", "named.pt"):
        (d / tmp).unlink()
    return d / name


def _raw(name: str, content: bytes, cmd: str):
    def build(d):
        (d / name).write_bytes(content)
        return [cmd, str(d / name)]
    return build


def _truncated_snapshot(d: Path) -> list[str]:
    full = write_snapshot(d / "full.pt", snapshot_dict()).read_bytes()
    (d / "full.pt").unlink()
    (d / "snap.pt").write_bytes(full[: len(full) // 2])
    return ["replay", str(d / "snap.pt")]


def _deep_batch(d: Path) -> list[str]:
    deep: list = []
    cur = deep
    for _ in range(300):  # deeper than the limit, shallow enough for torch.save's pickler
        cur.append([])
        cur = cur[0]
    return ["replay", str(write_snapshot(d / "snap.pt", snapshot_dict(batch=deep)))]


def _flipped(name: str, cmd: str, record: str):
    """A real torch file with one byte flipped in the middle of `record` (torch.load still reads it)."""
    def build(d):
        src = (write_snapshot(d / "full.pt", snapshot_dict()) if cmd == "replay"
               else (torch.save({"w": torch.randn(256), "b": torch.randn(4)}, d / "full.pt") or d / "full.pt"))
        raw = bytearray(src.read_bytes())
        with zipfile.ZipFile(src) as zf:
            info = next(i for i in zf.infolist() if i.filename.split("/", 1)[1] == record)
        head = info.header_offset
        start = head + 30 + int.from_bytes(raw[head + 26:head + 28], "little") + int.from_bytes(raw[head + 28:head + 30],
                                                                                               "little")
        raw[start + info.compress_size // 2] ^= 0x10
        src.unlink()
        (d / name).write_bytes(bytes(raw))
        return [cmd, str(d / name)]
    return build


_NUL_CSV = "step,loss\n1,2\n2,\x003\n"
_DEEP_JSON = "[" * 100_000 + "]" * 100_000

CASES: list[tuple[str, Callable[[Path], list[str]]]] = [
    # snapshots: every key's type and range
    ("snapshot rng too short", snapshot_case(rng={"cpu": torch.zeros(10, dtype=torch.uint8), "cuda": None})),
    ("snapshot rng wrong dtype", snapshot_case(rng={"cpu": torch.zeros(5056), "cuda": None})),
    ("snapshot rng not a dict", snapshot_case(rng=[1, 2])),
    ("snapshot rng garbage state", snapshot_case(rng={"cpu": torch.full((5056,), 7, dtype=torch.uint8), "cuda": None})),
    ("snapshot model_state a list", snapshot_case(model_state=[torch.zeros(2)])),
    ("snapshot model_state nested", snapshot_case(model_state={"a": {"b": torch.zeros(2)}})),
    ("snapshot model_state int key", snapshot_case(model_state={1: torch.zeros(2)})),
    ("snapshot scaler_state nan scale", snapshot_case(scaler_state={"scale": float("nan"), "growth_interval": 5})),
    ("snapshot scaler_state str interval", snapshot_case(scaler_state={"scale": 2.0, "growth_interval": "x"})),
    ("snapshot negative format_version", snapshot_case(format_version=-1)),
    ("snapshot bool format_version", snapshot_case(format_version=True)),
    ("snapshot step a string", snapshot_case(step="3")),
    ("snapshot negative rank", snapshot_case(rank=-1)),
    ("snapshot train_mode a string", snapshot_case(train_mode="yes")),
    ("snapshot reason a tensor", snapshot_case(reason=torch.zeros(1))),
    ("snapshot factory_kwargs a list", snapshot_case(factory_kwargs=[1])),
    ("snapshot stride-0 batch of 3e9", snapshot_case(batch={"x": torch.zeros(1).expand(3_000_000_000)})),
    ("snapshot stride-0 weight", snapshot_case(model_state={"weight": torch.zeros(1).expand(1000, 1000)})),
    ("snapshot batch nested 300 deep", _deep_batch),
    ("snapshot truncated", _truncated_snapshot),
    ("snapshot garbage", _raw("snap.pt", b"\x80\x02garbage" * 50, "replay")),
    ("snapshot deep pickle", lambda d: ["replay", str(_deep_torch(d, "snap.pt"))]),
    ("snapshot zip bomb", lambda d: ["replay", str(zip_bomb(d, "snap.pt", 4_000_000))]),
    ("snapshot flipped byte in a tensor", _flipped("snap.pt", "replay", "data/0")),
    # checkpoints
    ("checkpoint deep pickle", _torch_file("ckpt.pt", _deep_torch)),
    ("checkpoint zip bomb", _torch_file("ckpt.pt", lambda d, n: zip_bomb(d, n, 4_000_000))),
    ("checkpoint empty", _raw("ckpt.pt", b"", "inspect")),
    ("checkpoint stride-0 weight of 3e9", _torch_file("ckpt.pt", _stride0_checkpoint)),
    ("checkpoint re-zipped unaligned", _torch_file("ckpt.pt", _unaligned_checkpoint)),
    ("checkpoint bad param_groups", _torch_file("ckpt.pt", _bad_param_groups)),
    ("checkpoint zip name not utf-8", _torch_file("ckpt.pt", _bad_zip_name)),
    ("snapshot zip name not utf-8", lambda d: ["replay", str(_bad_zip_name(d, "snap.pt"))]),
    ("checkpoint garbage", _raw("ckpt.pt", bytes(range(256)) * 8, "inspect")),
    ("checkpoint flipped byte in a tensor", _flipped("ckpt.pt", "inspect", "data/0")),
    ("checkpoint flipped byte in data.pkl", _flipped("ckpt.pt", "inspect", "data.pkl")),
    ("safetensors bool shape", _safetensors({"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}})),
    ("safetensors 2**63 shape", _safetensors({"w": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})),
    ("safetensors offsets past the end", _safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}})),
    ("safetensors deep header", _safetensors(b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}")),
    ("safetensors header not utf-8", _safetensors(b'{"w": "\xff\xfe"}')),
    ("safetensors duplicate keys", _safetensors(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                                                b'"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}')),
    # meta.json values
    ("meta rank 1e400", _meta_text(json.dumps(_meta()).replace('"rank": 0', '"rank": 1e400').encode())),
    ("meta rank a string", _meta_case(rank="zero")),
    ("meta rank negative", _meta_case(rank=-3)),
    ("meta world_size 0", _meta_case(world_size=0)),
    ("meta shape of bools", _meta_case(params=[{"name": "w", "shape": [True, -1]}])),
    ("meta shape negative", _meta_case(params=[{"name": "w", "shape": [4, -1]}])),
    ("meta numel a string", _meta_case(params=[{"name": "w", "numel": "many"}])),
    ("meta params a dict", _meta_case(params={"w": 1})),
    ("meta name a list", _meta_case(params=[{"name": ["w"], "numel": 4}])),
    ("meta negative format_version", _meta_case(format_version=-1)),
    ("meta deep nesting", _meta_text(b'{"format": "amp-autopsy.run", "x": ' + _DEEP_JSON.encode() + b"}")),
    ("meta 150 deep", _meta_text(json.dumps(_meta(extra=json.loads("[" * 150 + "]" * 150))).encode())),
    ("meta not utf-8", _meta_text(b'{"format": "\xff\xfe"}')),
    ("meta 5000-digit number", _meta_text(json.dumps(_meta(pid=1)).replace('"pid": 1', '"pid": ' + "9" * 5000).encode())),
    ("meta 5000-digit shape", _meta_text(json.dumps(_meta()).replace('"shape": [4]', '"shape": [' + "9" * 5000 + "]",
                                                                     1).encode())),
    # Parquet parts
    ("part step column of strings", _bad_steps(lambda: Script(n=20).steps_frame().with_columns(
        pl.col("step").cast(pl.String)))),
    ("part rank overflowing Int32", _bad_steps(lambda: Script(n=20).steps_frame().with_columns(
        pl.lit(2**40).alias("rank")))),
    ("part loss column of bools", _bad_steps(lambda: Script(n=20).steps_frame().with_columns(
        pl.lit(True).alias("loss")))),
    ("part corrupt data page", _corrupt_page),
    ("part that panics the decoder", _panicking_part),
    ("part zero rows", _bad_steps(lambda: Script(n=20).steps_frame().head(0))),
    # foreign logs
    ("hf step inf", _file("trainer_state.json", json.dumps({"log_history": [{"step": "inf", "loss": 1.0}]}))),
    ("hf step 1e400", _file("trainer_state.json", '{"log_history": [{"step": 1e400, "loss": 1.0}]}')),
    ("hf step 10**30", _file("trainer_state.json", json.dumps({"log_history": [{"step": 10**30, "loss": 1.0}]}))),
    ("hf rank negative", _file("trainer_state.json", json.dumps({"log_history": [{"step": 1, "loss": 1.0, "rank": -1}]}))),
    ("hf deep nesting", _file("trainer_state.json", '{"log_history": ' + _DEEP_JSON + "}")),
    ("hf not utf-8", _file("trainer_state.json", b'{"log_history": ["\xff"]}')),
    ("hf 5000-digit step", _file("trainer_state.json", '{"log_history": [{"step": ' + "9" * 5000 + ', "loss": 1}]}')),
    ("jsonl 5000-digit step", _file("log.jsonl", '{"step": ' + "9" * 5000 + ', "loss": 2}\n')),
    ("hf log_history of numbers", _file("trainer_state.json", '{"log_history": [1, 2, 3]}')),
    ("lightning csv with a NUL byte", _file("metrics.csv", _NUL_CSV)),
    ("lightning csv not utf-8", _file("metrics.csv", b"step,loss\n1,\xff\xfe\n")),
    ("lightning csv row cut short", _file("metrics.csv", "epoch,step,train_loss_step\n0,1,2.0\n0,2,1.9\n0,3\n")),
    ("lightning csv column twice", _file("metrics.csv", "epoch,step,loss,loss\n0,1,2.0,9\n0,2,1.9,9\n")),
    ("csv huge field", _file("log.csv", "step,loss\n1," + "9" * 200_000 + "\n")),
    ("csv step nan", _file("log.csv", "step,loss\nnan,1.0\n")),
    ("csv step 5000 digits", _file("log.csv", "step,loss\n" + "9" * 5000 + ",1.0\n")),
    ("csv extra fields", _file("log.csv", "step,loss\n1,2,3,4,grad_x\n")),
    ("jsonl garbage line", _file("log.jsonl", '{"step": 1, "loss": 2}\n{not json\n')),
    ("jsonl deep line", _file("log.jsonl", _DEEP_JSON + "\n")),
    ("jsonl not utf-8", _file("log.jsonl", b'{"step": 1, "loss": "\xff"}\n')),
    ("jsonl step a dict", _file("log.jsonl", '{"step": {"a": 1}, "loss": 2}\n')),
    ("deepspeed 5000-digit step", _file("train.log", "steps: " + "9" * 5000 + " loss: 1.0\n")),
    ("deepspeed huge rank", _file("train.log", "[deepspeed] OVERFLOW! Rank " + "9" * 30
                                  + " Skipping step. Attempted loss scale: 65536, reducing to 32768\n")),
    ("deepspeed scale of dots", _file("train.log", "[deepspeed] OVERFLOW! Rank 0 Skipping step. "
                                      "Attempted loss scale: ..., reducing to ...\n")),
    ("deepspeed scale nan", _file("train.log", "steps: 1 loss: 2.0\n[deepspeed] OVERFLOW! Rank 0 Skipping step. "
                                  "Attempted loss scale: nan, reducing to nan\n")),
    ("megatron nan iteration", _file("train.log", "iteration nan/ 100 | lm loss: 1.0 |\n")),
    ("megatron inf iteration", _file("train.log", "iteration 5/ 100 | lm loss: 1.0 |\niteration inf/ 100 | lm loss: "
                                     "1.0 |\n")),
    ("megatron huge iteration", _file("train.log", "iteration " + "9" * 40 + "/ 100 | lm loss: 1.0 |\n")),
    ("megatron inf skipped", _file("train.log", "iteration 5/ 100 | lm loss: 1.0 | number of skipped "
                                   "iterations: inf | number of nan iterations: 1e999 |\n")),
    ("tensorboard garbage events", _raw("events.out.tfevents.1.host", b"\x00\x01garbage" * 64, "report")),
]
