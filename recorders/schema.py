"""The on-disk contract of a run directory: format version, file names, trace columns, snapshot keys.

The analyzer imports this module (and the import rule, ``recorders.imports``) to read what the
recorder wrote. Changing anything here is a format change: bump ``FORMAT_VERSION`` and keep
readers able to say clearly what they cannot read.

Run-directory layout::

    RUN_DIR/
      meta.json                          # rank 0 (world_size 1: the only rank)
      meta-r00001.json                   # one per extra rank under torch.distributed
      meta-r00000-w1.json                # a second process that also claimed rank 0 (writer 1)
      trace/steps-r00000-p000000.parquet # one row per step          (STEP_COLUMNS)
      trace/layers-r00000-p000000.parquet# one row per (step, param) (LAYER_COLUMNS)
      snapshots/step00000042-r00000-nonfinite_loss.pt
      trace/steps-r00000-w1-p000000.parquet  # writer 1's parts; its snapshots: step...-r00000-w1-...pt

Parts are written to a temporary name (leading ``.``, suffix ``.tmp``), fsynced and then
*claimed* under their final name with a hard link, which fails instead of overwriting: two
processes writing one directory never destroy each other's parts. A reader never sees half
a part: files whose names start with ``.`` are ignored.

Writers: the first process recording a rank writes the version-1 names above (writer 0).
Another process that finds that rank already claimed by a live process (every process of a
multi-GPU launch without torch.distributed is rank 0) takes the next writer number and puts
``-wN`` after the rank in all its file names. Readers list files with ``META_RE``, ``PART_RE``
and ``SNAPSHOT_RE`` (never glob patterns: a ``[`` in a path is a glob character).

Versions: 1 is the original layout. 2 adds writer names (``-wN``) and the ``cwd`` key to
meta.json and snapshots (``KEYS_ADDED``: keys that files of older versions may lack).
3 adds snapshot keys, among them ``sdpa`` (the attention-backend switches).
3 also adds ``fsdp`` to meta.json (``META_KEYS_ADDED``) and to snapshots: FSDP2 (``fully_shard``)
runs record their mixed-precision policy, mesh and, per parameter, this rank's shard
(``sharded``, ``local_shape``, ``local_numel``, ``local_offset`` in ``params`` entries); their
snapshots keep the weights in a DCP directory ``snapshots/step00000042-nonfinite_loss.dcp``
(``dcp_dir_name``) shared by every rank, or this rank's local shards (see ``SNAPSHOT_KEYS``).
3 also records the optimizer (meta.json and snapshot key ``optimizer``), ``update`` snapshots
(``check_update=True``: the step whose update made weights non-finite) and the layer columns
``update_rms`` and ``unchanged_frac`` (``COLUMNS_ADDED``: trace columns older parts lack, read as null).
4 adds ``step_numbering`` and ``micro_batches`` to meta.json: whose numbering the ``step`` column uses
(``STEP_NUMBERINGS``: the loop's own, HF Trainer's ``global_step``, Lightning's ``trainer.global_step``)
and how many forwards of accumulated micro-batches one recorded step sums (older runs: read as
``"loop"`` and None). It also adds ``exception`` to meta.json and snapshots: a loop that raised
inside the Recorder's ``with`` block (``EXCEPTION_KEYS``); a step that raised between ``begin_step``
5 adds ``compile`` to meta.json and snapshots: how a ``torch.compile``'d model was compiled (backend,
mode, dynamic, fullgraph, which submodules); names never carry ``_orig_mod.`` (older snapshots may).
6 adds ``micro_batches`` to snapshots: a step that accumulated gradients keeps every micro-batch (``batch``
is their list) and how their losses were combined (``MICRO_BATCH_KEYS``); and ``micro_batches_kept`` to
meta.json: True once the run's snapshots hold every micro-batch of their step (older runs: None).
7 adds ``warnings`` to meta.json: every RecorderWarning the recorder issued, by kind (``WARNING_KINDS``) and step
(``WARNING_KEYS``; older runs: None, nothing known).
7 also adds the spike snapshots: reasons ``loss_spike`` and ``grad_spike``, the snapshot key ``spike`` (what was
measured against which baseline, ``SPIKE_KEYS``) and ``spikes`` in meta.json (the settings; older runs: None).
8 adds the snapshot key ``rewind`` (``Recorder(rewind=K)``): the state at a start at least K steps before the
snapshot's step and every step since (``REWIND_KEYS``, ``REWIND_STEP_KEYS``; older snapshots: None).
It also adds FP8 training: ``fp8_recipe`` in meta.json and snapshots (``recorders.fp8_recipe.describe_fp8``: the torchao
recipe, None without FP8 modules), ``fp8`` in meta.json (the FP8 statistics' settings, ``FP8_SETTINGS``) and in
snapshots (the step's casts and the one that fired, ``FP8_KEYS``), the snapshot reason ``fp8`` and the trace part
kind ``fp8`` (``trace/fp8-r00000-p000000.parquet``, ``FP8_COLUMNS``: one row per FP8 module, operand role and call
on the steps the statistics were taken). Older runs have no fp8 parts and read these keys as None.
It also adds ``modules`` to the ``fsdp`` entry of meta.json and snapshots: every ``fully_shard``-ed module (``path``,
its ``mp_policy`` and ``gradient_divide_factor``: None is FSDP2's default mean), what the distributed replay
shards again and reduces with (older runs: absent, the root module alone is sharded with the recorded policy).
9 adds MXFP8 recipes: an MXFP8 entry of ``fp8_recipe`` names, per operand role, ``block_size`` (elements per e8m0
scale) and ``scale_rounding`` (``"rceil"`` or ``"floor"``; older runs: absent, read as 32 and from the granularity),
and a snapshot's ``model_state`` holds torchao's MXFP8 training weights as plain tensors (older MXFP8 snapshots
hold the wrapper class, which ``weights_only`` loading refuses).
9 also counts every FP8 cast the recipe makes: each operand role once per GEMM that reads it (``FP8_USES``), in that
GEMM's format, granularity and axis. The ``fp8`` trace parts gain the column ``use``, a snapshot's ``fp8`` casts and
``fired`` the key ``use``, and a role entry of ``fp8_recipe`` the key ``uses`` (its format, granularity and scaling
per use). Older runs: no ``use``, read as the role's first use (``FP8_FIRST_USE``).
9 also adds ``ddp`` to meta.json and snapshots: a model wrapped in ``DistributedDataParallel``, what shapes its gradient
all-reduce (``DDP_KEYS``: the communication hook if it is one of torch's built-in ones, the dtype of the sum, where the
division by the world size happens, ``gradient_as_bucket_view``; older runs: None, nothing known).
"""
from __future__ import annotations

import re

import polars as pl

__all__ = [
    "FORMAT_VERSION",
    "META_FILE",
    "TRACE_DIR",
    "SNAPSHOT_DIR",
    "STEP_COLUMNS",
    "LAYER_COLUMNS",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_KEYS",
    "META_KEYS",
    "META_FORMAT",
    "meta_name",
    "part_name",
    "snapshot_name",
    "STEPS_GLOB",
    "LAYERS_GLOB",
    "SNAPSHOT_GLOB",
    "META_RE",
    "PART_RE",
    "SNAPSHOT_RE",
    "KEYS_ADDED",
    "SDPA_BACKENDS",
    "META_KEYS_ADDED",
    "DDP_KEYS",
    "DDP_HOOKS",
    "STEP_NUMBERINGS",
    "COLUMNS_ADDED",
    "DCP_RE",
    "dcp_dir_name",
    "dtype_name",
    "dtype_from_name",
    "REASON_EXCEPTION",
    "EXCEPTION_KEYS",
    "MICRO_BATCH_KEYS",
    "MICRO_BATCH_COMBINES",
    "WARNING_KEYS", "WARNING_KINDS", "MAX_WARNINGS", "MAX_WARNING_CHARS",
    "NONFINITE_LOSS", "NONFINITE_GRADS", "SCALE_COLLAPSE", "OVERFLOW_STREAK", "MANUAL", "PEER_FAILURE", "UPDATE",
    "LOSS_SPIKE", "GRAD_SPIKE", "SPIKE_KEYS", "SPIKE_SETTINGS", "REWIND_KEYS", "REWIND_STEP_KEYS",
    "LOSS_SPIKE", "GRAD_SPIKE", "SPIKE_KEYS", "SPIKE_SETTINGS",
    "FP8", "FP8_COLUMNS", "FP8_GLOB", "FP8_KEYS", "FP8_CAST_KEYS", "FP8_SETTINGS", "FP8_ROLES", "FP8_FLUSH_LIMIT",
    "FP8_SATURATE_LIMIT", "FP8_USES", "FP8_FIRST_USE", "PART_KINDS",
]

FORMAT_VERSION = 9

META_FILE = "meta.json"
TRACE_DIR = "trace"
SNAPSHOT_DIR = "snapshots"
STEPS_GLOB = "steps-r*-p*.parquet"
LAYERS_GLOB = "layers-r*-p*.parquet"
FP8_GLOB = "fp8-r*-p*.parquet"  # since version 8
SNAPSHOT_GLOB = "step*-r*-*.pt"
# Readers match listed names against these (groups: rank, writer; kind, rank, writer, index;
# step, rank, writer, reason). The writer group is None for writer 0.
META_RE = re.compile(r"^meta(?:-r(\d+)(?:-w(\d+))?)?\.json$")
PART_KINDS = ("steps", "layers", "fp8")  # fp8: since version 8
PART_RE = re.compile(r"^(steps|layers|fp8)-r(\d+)(?:-w(\d+))?-p(\d+)\.parquet$")
SNAPSHOT_RE = re.compile(r"^step(\d+)-r(\d+)(?:-w(\d+))?-(.+)\.pt$")

# One row per recorded step and rank.
STEP_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64,          # the loop's step number as passed to begin_step
    "rank": pl.Int32,          # torch.distributed rank, 0 when not distributed
    "wall_time": pl.Float64,   # unix seconds at end_step
    "loss": pl.Float64,        # unscaled loss; NaN/Inf kept as they are
    "loss_dtype": pl.String,   # "float32", "float16", "bfloat16", ...
    "scale": pl.Float64,       # GradScaler scale used for this step's backward; null without scaler
    "skipped": pl.Boolean,     # GradScaler skipped the optimizer step (found inf); null if unknown
    "grad_norm": pl.Float64,   # total L2 norm of the unscaled gradients
    "lr": pl.Float64,          # learning rate of the optimizer's first param group; null if none
    "nonfinite_grads": pl.Int64,  # number of non-finite gradient elements over all params
}

# Long format: one row per (step, rank, parameter). `layer` indexes meta.json["params"].
LAYER_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64,
    "rank": pl.Int32,
    "layer": pl.Int32,             # index into meta["params"] (model order)
    "grad_norm": pl.Float32,       # unscaled L2 norm of this parameter's gradient; null if no grad
    "param_norm": pl.Float32,      # L2 norm of the parameter (since version 4, on healthy steps: from the sample)
    "grad_nonfinite": pl.Int64,    # count of NaN/Inf gradient elements
    "grad_zero_frac": pl.Float32,  # fraction of gradient elements exactly zero (version 4, healthy steps: sampled)
    # Since version 3, over a fixed sample of the parameter (all elements up to 4096, else 64 evenly
    # spaced runs of 64 contiguous elements), against the previous recorded row of that parameter;
    # null on its first recorded row:
    "update_rms": pl.Float32,      # RMS of (w_now - w_at_previous_recorded_row); NaN once w is NaN
    "unchanged_frac": pl.Float32,  # fraction of sampled elements bitwise unchanged since then
}
# Trace columns (steps and layers) added after version 1, with the version that added them: parts
# of older versions lack them and readers give null.
COLUMNS_ADDED: dict[str, int] = {"update_rms": 3, "unchanged_frac": 3, "use": 9}

# Since version 8, long format: one row per (step, rank, FP8 module, operand role, use, call) on the steps whose FP8
# casts were measured (Recorder(fp8_every=N): every N-th step). Each row is one scaled cast as
# ``recorders.fp8.cast_counts`` counts it, in the recipe's format, granularity and axis for that role's use: the GEMM
# that reads the cast (FP8_USES; since version 9: older rows measured the first use, FP8_FIRST_USE, and lack the
# column). A tensorwise second use in the first use's format makes the same counts and has no row of its own.
# Fractions: flushed / nonzero, saturated / numel.
FP8_COLUMNS: dict[str, pl.DataType] = {
    "step": pl.Int64,
    "rank": pl.Int32,
    "module": pl.String,        # the FP8 module's name (model.named_modules(), without _orig_mod.)
    "role": pl.String,          # FP8_ROLES
    "use": pl.String,           # since version 9: FP8_USES, the GEMM that reads the cast (older: null, the first use)
    "call": pl.Int32,           # 0 for the module's first forward of the step (micro-batches, reuse: 1, 2, ...)
    "format": pl.String,        # "e4m3" | "e5m2"
    "granularity": pl.String,   # recorders.fp8.GRANULARITIES: "tensorwise" | "rowwise" | "mxfp8" | "mxfp8_floor"
    "numel": pl.Int64,          # elements cast
    "nonzero": pl.Int64,        # of them not exactly 0 before the cast
    "amax": pl.Float64,         # the largest |x| (NaN when x held NaN)
    "saturated": pl.Int64,      # scaled |x| beyond the format's max, before the clamp
    "flushed": pl.Int64,        # non-zero values that became exactly 0
    "subnormal": pl.Int64,      # values that became non-zero subnormals
    "scale_min": pl.Float64,    # the smallest and largest scale of the cast (one for tensorwise)
    "scale_max": pl.Float64,
}
FP8_ROLES = ("input", "weight", "grad_output")
# The GEMMs of a torchao FP8 Linear that read a cast (replay's CastWatch names them alike): the forward output GEMM
# (input, weight), the input-gradient GEMM (grad_output, weight) and the weight-gradient GEMM (grad_output, input).
FP8_USES = ("forward", "input gradient", "weight gradient")
# Each role's first use: what rows and casts of version 8, which name no use, measured.
FP8_FIRST_USE = {"input": "forward", "weight": "forward", "grad_output": "input gradient"}
# An FP8 cast fires the ``fp8`` snapshot (and the report's fp8 check) when more than FP8_FLUSH_LIMIT of its non-zero
# values flush to zero, or more than FP8_SATURATE_LIMIT of its values saturate (analyzer fp8-readiness's limits).
FP8_FLUSH_LIMIT = 0.05
FP8_SATURATE_LIMIT = 1e-4

META_KEYS = (
    "format", "format_version", "torch_version", "amp_autopsy_version", "created", "host",
    "pid", "rank", "world_size", "device_type", "amp_dtype", "scaler", "params", "buffers",
    "factory", "factory_kwargs", "loss_fn", "layer_every", "flush_every",
    "cwd",  # since version 2: the training process's os.getcwd(), where replay looks for user code
    "fsdp",  # since version 3: None | {"mp_policy": {...}, "mesh": {...}, "world_size": int,
             #   since version 8 "modules": [...] as in snapshots} (FSDP2 runs)
    "optimizer",  # since version 3: None | {"class": "torch.optim.adam.Adam", "param_groups": [{"lr", "eps",
                  #   "betas", "weight_decay", ... every JSON-able hyperparameter, "params": [index into
                  #   params, None for a tensor not in the model]}]}, recorded at setup
    "step_numbering",  # since version 4: a key of STEP_NUMBERINGS, whose numbers the step column holds
    "micro_batches",  # since version 4: int >= 1, forwards (accumulated micro-batches) per recorded step,
                      #   as the loop or framework declared it; None when not declared
    "exception",  # since version 4: None, or the exception the loop raised inside the Recorder's `with`
                  #   block: EXCEPTION_KEYS (step: the open step it raised in, None outside any step)
    "steps_begun",  # since version 4: begin_step calls so far (rewritten at close; 0 before)
    "autocast",  # since version 4: None | {"device_type", "enabled": bool, "dtype": str | None, "active_on":
                 #   [other device types with autocast on], "inside_forward": bool (entered inside
                 #   model.forward, as accelerate does; dtype then None if the outputs were cast back to FP32),
                 #   "step": int}: what the first recorded step's
                 #   training forward saw (amp_dtype FP16/BF16 runs only; recorders/_mistakes.py)
    "compile",  # since version 5: None (nothing compiled) | how the model was torch.compile'd (see "compile" after KEYS_ADDED)
    "micro_batches_kept",  # since version 6: True when snapshots hold every micro-batch of their step (the
                           #   callbacks from the start; a loop once a snapshot held a list of them); else None
    "warnings",  # since version 7: [WARNING_KEYS dicts], the RecorderWarnings issued so far, oldest first (at
                 #   most MAX_WARNINGS; rewritten when one is issued); [] when none
    "spikes",  # since version 7: the spike triggers' settings, SPIKE_SETTINGS (recorders/_spikes.py)
    "fp8_recipe",  # since version 8: recorders.fp8_recipe.describe_fp8(model), None without FP8 modules
    "fp8",  # since version 8: None (no FP8 module) | FP8_SETTINGS, the FP8 statistics' settings (recorders/_fp8_watch.py)
    "ddp",  # since version 9: None (no DistributedDataParallel found) | DDP_KEYS (recorders/_ddp.py); rewritten when the
            #   wrapper is found during the first forward (a Recorder given the wrapped module)
)
# meta.json keys added after version 1, with the version that added them (older runs lack them).
META_KEYS_ADDED: dict[str, int] = {"cwd": 2, "fsdp": 3}
META_KEYS_ADDED["optimizer"] = 3  # the optimizer's class and hyperparameters (recorders/_update.py)
META_KEYS_ADDED["step_numbering"] = 4  # older runs: "loop"
META_KEYS_ADDED["micro_batches"] = 4  # older runs: None
# meta.json "step_numbering": what a recorded step number means.
STEP_NUMBERINGS: dict[str, str] = {
    "loop": "the number the training loop passed to begin_step",
    "hf_trainer": ("HF Trainer's global_step after the step: 1 for the first optimizer step, as in "
                   "trainer_state.json's log_history, the logged 'step' and checkpoint-N"),
    "lightning": ("Lightning's trainer.global_step when the step starts: 0 for the first optimizer "
                  "step, as in the step column of metrics.csv and the loggers"),
}
META_KEYS_ADDED["exception"] = 4  # the exception the loop raised (recorders/_exception.py)
META_KEYS_ADDED["steps_begun"] = 4  # begin_step calls: an empty trace with steps begun means end_step was never called
META_KEYS_ADDED["autocast"] = 4  # whether autocast was active during the forward (recorders/_mistakes.py)
META_KEYS_ADDED["compile"] = 5  # how the model was compiled (recorders/compiled.py); older runs: None
META_KEYS_ADDED["micro_batches_kept"] = 6  # snapshots hold every micro-batch (recorders/micro_batches.py); older runs: None
META_KEYS_ADDED["warnings"] = 7  # the RecorderWarnings issued (recorders/_lifecycle.py); older runs: None
# One entry of meta.json's "warnings", in this order: kind (a key of WARNING_KINDS: a stable name, never the text),
# step (the step begin_step last named, None before the first), message (the warning's text, at most
# MAX_WARNING_CHARS characters).
WARNING_KEYS = ("kind", "step", "message")
MAX_WARNINGS = 32  # each kind warns about once per run: a cap, not a budget
MAX_WARNING_CHARS = 1000
WARNING_KINDS: dict[str, str] = {
    "scaled_loss": "end_step was given scaler.scale(loss): the trace holds loss x scale",
    "end_step_missing": "begin_step ran without end_step: a step (or every step) was not recorded",
    "autocast_inactive": "amp_dtype said FP16/BF16 but autocast was not active during the forward",
    "autocast_dtype": "autocast ran in another dtype than amp_dtype",
    "shared_rank": "another live process already records this rank (a second writer)",
    "write_error": "the recorder could not write part of its record (the disk); the record is incomplete",
    "stopped": "an internal error stopped the recording; training went on",
    "no_step_hook": "check_update=True without a torch.optim.Optimizer: optimizer steps were not checked",
    "post_forward_buffers": "a snapshot holds buffers written in place by the forward (post-forward values)",
    "exception_not_recorded": "the exception the loop raised could not be recorded completely",
    # the HF Trainer callback's own (recorders/integrations/hf.py)
    "fp16_cpu_as_fp32": "HF Trainer fp16=True on CPU made no autocast or GradScaler: the run trained, and is recorded, "
                        "in FP32",
    "grads_post_clip": "HF Trainer: the backward did not run through the model's loss, so the gradients were read "
                       "after clipping (post-clip norms)",
    "positional_inputs": "HF Trainer: the model was called with positional inputs; only keyword inputs are in the "
                         "recorded batch",
    "step_not_recorded": "HF Trainer: recording a step failed inside the Trainer's backward; that step is missing",
    "ddp_comm_hook": "DDP's communication hook is not one of torch's built-in ones: its numerics are unknown",
    "rewind_off": "Recorder(rewind=K) could not keep the window (an FSDP2-sharded model): snapshots hold one step",
}
META_KEYS_ADDED["spikes"] = 7  # the spike triggers' settings (recorders/_spikes.py); older runs: None
META_KEYS_ADDED["fp8_recipe"] = 8  # the torchao FP8 recipe (recorders/fp8_recipe.py); older runs: None
META_KEYS_ADDED["fp8"] = 8  # the FP8 statistics' settings (recorders/_fp8_watch.py); older runs: None
META_KEYS_ADDED["ddp"] = 9  # what shapes DDP's gradient all-reduce (recorders/_ddp.py); older runs: None
# meta.json's and a snapshot's "ddp" (version 9), in this order: world_size (int | None: DDP's process group), comm_hook
# (None: no hook, DDP's reducer all-reduces in the gradients' dtype | "allreduce_hook" | "fp16_compress_hook" |
# "bf16_compress_hook": torch's built-in hooks, Python or C++ | "unknown": another hook, or DDP's state unreadable),
# comm_hook_name (str | None: the hook's name as DDP's logger keeps it), reduce_dtype ("float16" | "bfloat16" | None:
# the gradients' own dtype), divide ("before": the gradients are divided by the world size before the sum, as DDP's
# reducer and every built-in hook do | None: unknown), gradient_as_bucket_view, broadcast_buffers (bool | None),
# bucket_cap_bytes (int | None), find_unused_parameters (bool | None), mixed_precision (None | {"param_dtype",
# "reduce_dtype", "buffer_dtype": str | None}: DDP's private mixed_precision config).
DDP_KEYS = ("world_size", "comm_hook", "comm_hook_name", "reduce_dtype", "divide", "gradient_as_bucket_view",
            "broadcast_buffers", "bucket_cap_bytes", "find_unused_parameters", "mixed_precision")
DDP_HOOKS = ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "unknown")
# meta.json's "fp8" (version 8): every (the Recorder's fp8_every: casts measured every N-th step; None: never),
# flush_limit, saturate_limit (the trigger's limits, FP8_FLUSH_LIMIT / FP8_SATURATE_LIMIT), max_snapshots (the
# cap on fp8 snapshots per run and rank), modules (the FP8 modules measured), transformer_engine (the names of
# Transformer Engine modules, whose fp8_meta snapshots keep).
FP8_SETTINGS = ("every", "flush_limit", "saturate_limit", "max_snapshots", "modules", "transformer_engine")
META_FORMAT = "amp-autopsy.run"

SNAPSHOT_FORMAT = "amp-autopsy.snapshot"
# Every snapshot is a plain dict with exactly these keys, readable by torch.load(weights_only=True).
SNAPSHOT_KEYS = (
    "format",            # SNAPSHOT_FORMAT
    "format_version",    # FORMAT_VERSION
    "torch_version",     # str
    "amp_autopsy_version",  # str
    "created",           # unix seconds
    "host", "rank", "world_size",
    "step",              # int
    "reason",            # "nonfinite_loss" | "nonfinite_grads" | "scale_collapse" | "overflow_streak" | "manual"
                         #   | "peer_failure" | "update" | "exception" (REASON_EXCEPTION) | "loss_spike" | "grad_spike"
                         #   | "fp8" | a user's own name
    "device_type",       # "cpu" | "cuda" (where the step ran)
    "amp_dtype",         # "float16" | "bfloat16" | None (FP32)
    "scale",             # float | None: the loss scale the failing backward used
    "scaler_state",      # GradScaler.state_dict() | None
    "factory",           # "pkg.mod:qualname"
    "factory_kwargs",    # JSON-serialisable dict
    "loss_fn",           # "pkg.mod:qualname"
    "train_mode",        # model.training at the step
    "model_state",       # {name: tensor on CPU}: parameters and buffers before the optimizer step
                         #   (reason "update": the parameters AFTER the step, buffers as they are then)
    "batch",             # the batch (tensors on CPU) in its nested dict/list/tuple structure
    "rng",               # {"cpu": uint8 tensor, "cuda": [uint8 tensor per device] | None}
    "loss",              # float: the recorded (unscaled) loss, NaN/Inf as is; None if unknown
    "loss_dtype",        # str | None
    "grad_norm",         # float | None: unscaled total gradient norm, if known
    "cwd",               # str: the training process's os.getcwd() (since version 2)
    "sdpa",              # since version 3: {"enabled": {"flash", "mem_efficient", "math", "cudnn": bool},
                         #   "math_reduced_precision": bool | None} as the process had them | None
    "fsdp",              # since version 3: None, or for a sharded (FSDP2) model, whose model_state is {}:
                         #   {"dcp_dir": "step00000042-nonfinite_loss.dcp" (under snapshots/, every rank's
                         #      shards: {"model": pre-step weights and buffers, "optim": optimizer state}) | None,
                         #    "mp_policy": {"param_dtype", "reduce_dtype", "output_dtype": str | None},
                         #    "mesh": {"device_type": str, "shape": [int], "dim_names": [str] | None,
                         #      since version 9 "placements": [str] | None, a parameter's per mesh dimension:
                         #      "replicate", "shard(D)", "partial" or another's str(); HSDP: ["replicate", "shard(0)"]}
                         #      | None,
                         #    "world_size": int,
                         #    "local_state": {name: tensor} | None (no dcp_dir: this rank's shards, buffers whole),
                         #    "layout": {name: {"shape": global shape, "offset": this shard's offset}} | None,
                         #    since version 8: "modules": [{"path": str ("" the root), "mp_policy": {...} | None,
                         #      "gradient_divide_factor": float | None}] (outermost first) | None}
    "optimizer",         # since version 3: None (no optimizer= given) | {"class": "torch.optim.adam.Adam",
                         #   "state_dict": optimizer.state_dict() (tensors on CPU; reason "update": post-step),
                         #   "param_names": [model parameter name | None, for each param id in param_groups order]}
    "update",            # since version 3: None | on reason "update" (check_update=True) only:
                         #   {"grads": {name: tensor} (the gradients the step used), "post_params": {name:
                         #    tensor} (every parameter after it), "nonfinite_params": [names it made NaN/Inf]}
    "exception",         # since version 4: None | on reason "exception" only: the exception the step raised
                         #   before end_step, EXCEPTION_KEYS (strings, and the step as an int)
    "compile",           # since version 5: None | how the model was compiled, as in meta.json (see below)
    "micro_batches",     # since version 6: None (batch is one batch) | the step accumulated gradients over the
                         #   micro-batches listed in batch: MICRO_BATCH_KEYS (recorders/micro_batches.py)
    "spike",             # since version 7: None | on reasons "loss_spike" / "grad_spike" only: SPIKE_KEYS
    "rewind",            # since version 8: None | Recorder(rewind=K): REWIND_KEYS (recorders/_rewind.py)
    "fp8_recipe",        # since version 8: as meta.json's (recorders.fp8_recipe.describe_fp8), None without FP8
    "fp8",               # since version 8: None (no FP8 module) | FP8_KEYS: this step's FP8 casts
    "ddp",               # since version 9: None | DDP_KEYS, as in meta.json, read when the snapshot was taken
)
# Keys added after version 1, with the version that added them: older files lack them, so
# readers treat them as optional (and use None).
KEYS_ADDED: dict[str, int] = {"cwd": 2}
KEYS_ADDED["sdpa"] = 3  # the SDPA backend switches (recorders/_sdpa.py)
KEYS_ADDED["fsdp"] = 3  # FSDP2 runs: where the sharded weights are (recorders/_fsdp.py)
KEYS_ADDED["optimizer"] = 3  # the optimizer's class, state_dict and parameter names (recorders/_update.py)
KEYS_ADDED["update"] = 3  # check_update=True: the update that made weights non-finite
KEYS_ADDED["exception"] = 4  # the exception a step raised before end_step (recorders/_exception.py)
KEYS_ADDED["compile"] = 5  # how the model was compiled (recorders/compiled.py); older files: None
KEYS_ADDED["micro_batches"] = 6  # every micro-batch of an accumulating step (recorders/micro_batches.py); older: None
KEYS_ADDED["spike"] = 7  # a spike snapshot's measurement against its baseline (recorders/_spikes.py); older: None
KEYS_ADDED["rewind"] = 8  # the rewind window: a start state and the steps since (recorders/_rewind.py); older: None

# A snapshot's "rewind" (version 8), in this order: steps_asked (int >= 1: Recorder(rewind=K)); start_step (the
# step at whose begin_step the start state was copied); model_state ({name: tensor}: weights and buffers then);
# optimizer (as the snapshot's "optimizer" key, the state then); steps (a list, start_step first and the snapshot's
# own step last, each REWIND_STEP_KEYS). A step's "optimizer_stepped" is True when the optimizer stepped after it
# (its step pre-hook ran), False when the step was skipped (GradScaler found inf), None for the snapshot's step;
# "param_groups" holds each group's hyperparameters as the optimizer stepped (numbers, bools, lists of numbers), or
# None; loss, scale, skipped, grad_norm and lr are the step's trace row's (STEP_COLUMNS).
REWIND_KEYS = ("steps_asked", "start_step", "model_state", "optimizer", "steps")
REWIND_STEP_KEYS = ("step", "batch", "micro_batches", "rng", "loss", "scale", "skipped", "grad_norm", "lr",
                    "optimizer_stepped", "param_groups")
KEYS_ADDED["fp8_recipe"] = 8  # the torchao FP8 recipe (recorders/fp8_recipe.py); older: None
KEYS_ADDED["fp8"] = 8  # the step's FP8 casts (recorders/_fp8_watch.py); older: None
KEYS_ADDED["ddp"] = 9  # what shapes DDP's gradient all-reduce (recorders/_ddp.py); older: None
# A snapshot's "fp8" (version 8), in this order: casts (None: the step's casts were not measured, it was no
# fp8_every-th step | [FP8_CAST_KEYS dicts], each cast of the step), fired (None | the FP8_CAST_KEYS dict of the cast
# that fired the ``fp8`` snapshot: the largest flushed, then saturated, fraction above the limits), flush_limit,
# saturate_limit, transformer_engine (None | {module name: {"class": str, "recipe": str | None, "scaling_fwd" /
# "scaling_bwd": {"amax_history": tensor (history, columns), "scale": tensor, "scale_inv": tensor (when the module
# has them), "columns": [names of the columns: "gemm1_input", "gemm1_weight", "gemm1_output" forward;
# "gemm1_grad_output", "gemm1_grad_input" backward]}}}: Transformer Engine's per-module FP8 state, copied at snapshot time).
FP8_KEYS = ("casts", "fired", "flush_limit", "saturate_limit", "transformer_engine")
# One cast in a snapshot's "fp8": the FP8_COLUMNS of its trace row without step and rank, and its fractions (``use``
# since version 9; older casts lack it and read as FP8_FIRST_USE of their role).
FP8_CAST_KEYS = ("module", "role", "use", "call", "format", "granularity", "numel", "nonzero", "amax", "saturated",
                 "flushed",
                 "subnormal", "scale_min", "scale_max", "flushed_frac", "saturated_frac", "subnormal_frac")

# A snapshot's "micro_batches" (version 6), in this order: count (int >= 1: len(batch)), combine (a key of
# MICRO_BATCH_COMBINES), divisor (float > 0: what each micro-batch's loss was divided by before its
# backward), source ("list": a list given to begin_step, "hf_trainer", "lightning"; "batch_file": a list
# of micro-batches given to `analyzer replay CHECKPOINT --batch`, never written to a snapshot),
# num_items_in_batch (int | None: HF Trainer's item count of the whole step, when the model took it).
MICRO_BATCH_KEYS = ("count", "combine", "divisor", "source", "num_items_in_batch")
MICRO_BATCH_COMBINES: dict[str, str] = {
    "mean": "each micro-batch's loss divided by the number of micro-batches",
    "num_items_in_batch": "each micro-batch's summed loss divided inside the model by the whole step's item count",
    "sum": "each micro-batch's loss as the loss function returns it, undivided",  # analyzer replay --accumulate sum
}

# meta.json's and every snapshot's "compile" (version 5), None when no part of the model was compiled:
#   {"modules": [{"path": "" (the whole model) | "layers.0" (a module path, without _orig_mod),
#                 "how": "torch.compile" (an OptimizedModule wrapper) | "module.compile" (in place),
#                 "backend": "inductor" | "aot_eager" | ... | None, "mode": "default" | "reduce-overhead" |
#                 "max-autotune" | "max-autotune-no-cudagraphs" | None, "dynamic": bool | None,
#                 "fullgraph": bool | None, "options": {Inductor option: value} | None}]}.
# Parameter and buffer names everywhere (meta.json params/buffers, model_state, optimizer param_names)
# are the original module's: torch.compile's "_orig_mod." segments are left out (since version 5).

# The reason of the snapshot Recorder.__exit__ writes when the loop raised inside an open step
# (begin_step ran, end_step did not): the pre-step state, the batch and the RNG of that step.
REASON_EXCEPTION = "exception"
# The exception entry of meta.json and of an "exception" snapshot, in this order:
#   type: "RuntimeError" (qualified when not a builtin: "torch.OutOfMemoryError"); message: str(exc),
#   at most 2000 characters; frames: the last user frames, innermost last, at most 8, as
#   "path/to/train.py:42 in main: clip_grad_norm_(...)" strings (torch's and amp-autopsy's own frames
#   left out); step: int | None (None: raised outside any open step); last_step: the last step
#   begin_step saw, or None; failure: True for an Exception, False for a KeyboardInterrupt/SystemExit
#   (an interruption: never snapshotted).
EXCEPTION_KEYS = ("type", "message", "frames", "step", "last_step", "failure")
# Snapshot reasons (the ``reason`` key, and the last part of a snapshot's file name).
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRADS = "nonfinite_grads"
SCALE_COLLAPSE = "scale_collapse"
OVERFLOW_STREAK = "overflow_streak"
MANUAL = "manual"  # Recorder.snapshot()'s default reason: not a failure
PEER_FAILURE = "peer_failure"  # another rank failed this step (sync_failures=True)
UPDATE = "update"  # the optimizer step made weights non-finite (check_update=True)
LOSS_SPIKE = "loss_spike"  # the loss jumped far above its trailing baseline (version 7)
GRAD_SPIKE = "grad_spike"  # the total gradient norm jumped far above its trailing baseline (version 7)
FP8 = "fp8"  # an FP8 cast flushed or saturated more than the limits (version 8): no failure
# A spike snapshot's "spike" (version 7), in this order: reason; metric ("loss" | "grad_norm"); value (the
# step's); baseline (the median of the trailing window); ratio (value / baseline); spread (the robust standard
# deviation of the step-to-step change of the log values over the window); threshold (the value above which
# the step spiked); factor (the setting); z (robust standard deviations required); window (values in the baseline).
SPIKE_KEYS = ("reason", "metric", "value", "baseline", "ratio", "spread", "threshold", "factor", "z",
              "window")
# meta.json's "spikes" (version 7): the Recorder's settings, None when both triggers are off.
SPIKE_SETTINGS = ("loss_spike", "grad_spike", "spike_window", "max_spike_snapshots")
# The DCP directory of a sharded snapshot, under snapshots/ (groups: step, reason).
DCP_RE = re.compile(r"^step(\d+)-([A-Za-z0-9_]+)\.dcp$")
# The snapshot's names of the SDPA backends: the keys of snapshot["sdpa"]["enabled"].
SDPA_BACKENDS = ("flash", "mem_efficient", "math", "cudnn")


def _writer(writer: int) -> str:
    return f"-w{writer}" if writer else ""


def meta_name(rank: int, writer: int = 0) -> str:
    """meta.json for rank 0, meta-r00007.json for rank 7, meta-r00000-w1.json for rank 0's writer 1."""
    if writer:
        return f"meta-r{rank:05d}{_writer(writer)}.json"
    return META_FILE if rank == 0 else f"meta-r{rank:05d}.json"


def part_name(kind: str, rank: int, index: int, writer: int = 0) -> str:
    """File name of trace part `index` of `kind` (``PART_KINDS``) for `rank` (and `writer`)."""
    if kind not in PART_KINDS:
        raise ValueError(f"kind must be one of {PART_KINDS}, got {kind!r}")
    return f"{kind}-r{rank:05d}{_writer(writer)}-p{index:06d}.parquet"


def dcp_dir_name(step: int, reason: str) -> str:
    """step00000042-nonfinite_loss.dcp: a sharded snapshot's DCP directory, one for all ranks."""
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in reason) or MANUAL
    return f"step{step:08d}-{safe}.dcp"


def snapshot_name(step: int, rank: int, reason: str, writer: int = 0) -> str:
    """step00000042-r00000-nonfinite_loss.pt; the reason is reduced to [A-Za-z0-9_]."""
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in reason) or MANUAL
    return f"step{step:08d}-r{rank:05d}{_writer(writer)}-{safe}.pt"


_DTYPES = {
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float64": "float64", "double": "float64", "fp64": "float64",
}


def dtype_name(dtype) -> str | None:
    """torch.float16 -> "float16"; None -> None. Accepts strings too."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.get(name, name)


def dtype_from_name(name: str | None):
    """"float16"/"fp16" -> torch.float16; None/"float32" -> None for amp purposes is the caller's call."""
    import torch

    if name is None:
        return None
    canon = _DTYPES.get(str(name).removeprefix("torch."))
    if canon is None:
        raise ValueError(f"unknown dtype name {name!r}")
    return getattr(torch, canon)
