#!/usr/bin/env bash
# bench/gpu_check.sh: the one-shot GPU check of issue 16 (section 3), for the day a GPU is lent.
#
# Every CUDA path of amp-autopsy is written but CI has no GPU. On a machine with one CUDA GPU this
# runs, in under 8 minutes (each step has its own timeout, and the timeouts add up to less):
#   1. the cuda-marked tests                     python -m pytest -m cuda
#   2. each sample's first snapshot replayed on  bench/replay_devices.py --device cuda
#      CUDA and on CPU: same verdict/op/module/phase?
#   3. the recorder's overhead on a ~98M-param   bench/recorder_overhead.py --device cuda --size 100m
#      GPT under CUDA AMP FP16 and BF16, and the    --dtype fp16 / --dtype bf16
#      host syncs per healthy step
#   4. the replay-cost benchmark on CUDA         bench/replay_cost.py --device cuda
# and writes ONE Markdown table (check | measured | target | result) to $OUT/gpu_check.md when
# $OUT is set, else to stdout; each step's full output goes to $OUT/gpu_check_logs/ (or stderr
# on failure). A failing or hanging step is a FAIL row, not the end of the check.
#
# Usage:
#   bash bench/gpu_check.sh            # on the GPU machine; exit 0 when every row passes, else 1
#   bash bench/gpu_check.sh --dry-run  # on any machine, CPU only: list every command a real run
#                                      # would execute, check each script and option exists,
#                                      # measure nothing; exit 0 when everything is in place
# PYTHON=/path/to/python overrides the interpreter (default: .venv/bin/python, else python3).
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "Error: bench/gpu_check.sh: unknown option '$arg'; run it with no option on a GPU machine, or with --dry-run" >&2
       exit 2 ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/amp-autopsy-gpu-check.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
ROWS=$WORK/rows.md
: > "$ROWS"
TOTAL_TARGET=480  # seconds: issue 16 asks for the whole check in under 8 minutes

# --- the steps: key, timeout (s), check name and target (for the row a failed step gets), command
KEYS=(); TIMEOUTS=(); NAMES=(); TARGETS=(); CMDS=(); OPTS=()
step() {  # step KEY TIMEOUT NAME TARGET OPTIONS-TO-CHECK -- COMMAND...
  local key=$1 timeout=$2 name=$3 target=$4 opts=$5; shift 6
  KEYS+=("$key"); TIMEOUTS+=("$timeout"); NAMES+=("$name"); TARGETS+=("$target"); OPTS+=("$opts")
  CMDS+=("$(printf '%q ' "$@")")
}
step cuda_tests 90 "cuda-marked tests (pytest -m cuda)" "all pass, none skipped" "" \
  -- "$PY" -m pytest -m cuda -q -p no:cacheprovider -rs
step replay_devices 160 "replay cuda vs cpu, every sample" "same verdict, op, module, phase" \
  "--device --work --budget --rows" \
  -- "$PY" bench/replay_devices.py --device cuda --work "$WORK/samples" --budget 150 --rows "$ROWS"
for dtype in fp16 bf16; do
  step "overhead_$dtype" 65 "recorder step / plain step, cuda $dtype, ~98M params" "<= 1.02x; 1 host sync per healthy step" \
    "--device --dtype --size --batch --rows" \
    -- "$PY" bench/recorder_overhead.py --device cuda --dtype "$dtype" --size 100m --batch 16 --rows "$ROWS"
done
step replay_cost 60 "replay run / plain fwd+bwd, cuda" "<= 1.5x" "--device --rows" \
  -- "$PY" bench/replay_cost.py --device cuda --rows "$ROWS"

budget=0; for t in "${TIMEOUTS[@]}"; do budget=$((budget + t)); done

table() {  # the one table, from the rows file
  echo "| check | measured | target | result |"
  echo "|---|---|---|---|"
  cat "$ROWS"
}

emit() {  # header lines + the table, to $OUT/gpu_check.md or stdout
  if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT" && { printf '%s\n\n' "$1"; table; } > "$OUT/gpu_check.md" \
      && echo "wrote $OUT/gpu_check.md" >&2
  else
    printf '%s\n\n' "$1"; table
  fi
}

# --- dry run: list, check that every script and option exists, measure nothing ---------------
if [[ $DRY == 1 ]]; then
  problems=0
  declare -A HELP=()  # script -> its --help (one interpreter start per script)
  probe=$("$PY" -c 'import torch; print(torch.__version__, "yes" if torch.cuda.is_available() else "no")' 2>&1) \
    || { echo "Error: $PY cannot import torch ($probe); set PYTHON=/path/to/python of the project's environment" >&2; exit 1; }
  echo "bench/gpu_check.sh --dry-run: torch ${probe% *}, CUDA available here: ${probe##* }."
  echo "DRY RUN: nothing below is run on a GPU and nothing is measured; the commands are only listed and checked."
  echo "A real run executes these steps, each under its own timeout (timeouts sum to ${budget} s; target: whole check < ${TOTAL_TARGET} s):"
  for i in "${!KEYS[@]}"; do
    echo "  $((i + 1)). [${KEYS[$i]}, timeout ${TIMEOUTS[$i]} s] ${CMDS[$i]}"
    read -r -a words <<< "${CMDS[$i]}"
    script=""
    for w in "${words[@]}"; do [[ $w == bench/*.py ]] && script=$w; done
    if [[ -n $script ]]; then
      if [[ -z ${HELP[$script]+x} ]]; then HELP[$script]=$("$PY" "$script" --help 2>&1) || HELP[$script]=FAILED; fi
      help=${HELP[$script]}
      if [[ $help == FAILED ]]; then
        echo "     MISSING: $script --help failed"; problems=$((problems + 1))
      else
        for opt in ${OPTS[$i]}; do
          grep -q -- "$opt" <<< "$help" || { echo "     MISSING: $script has no option $opt"; problems=$((problems + 1)); }
        done
        echo "     checked: $script --help runs and lists ${OPTS[$i]}"
      fi
    fi
    if [[ ${KEYS[$i]} == cuda_tests ]]; then
      listed=$("$PY" -m pytest -m cuda --collect-only -q -p no:cacheprovider 2>&1 | grep '::' || true)
      n=$(grep -c '::' <<< "$listed" || true)
      echo "     checked: pytest -m cuda collects $n test(s) (skipped here without CUDA):"
      sed 's/^/       /' <<< "$listed"
      [[ $n -gt 0 ]] || { echo "     MISSING: no cuda-marked test was collected"; problems=$((problems + 1)); }
    fi
    if [[ ${KEYS[$i]} == replay_devices ]]; then
      echo "     which runs, per sample (samples side by side; each trains on CPU, then replays on cpu and cuda):"
      "$PY" bench/replay_devices.py --device cuda --work "$WORK/samples" --dry-run | sed 's/^/       /'
      rhelp=$("$PY" -c "from analyzer.cli import main; main(prog_name='analyzer')" replay --help 2>&1)
      for opt in --device --json; do
        grep -q -- "$opt" <<< "$rhelp" || { echo "     MISSING: analyzer replay has no option $opt"; problems=$((problems + 1)); }
      done
      echo "     checked: analyzer replay --help lists --device --json"
    fi
    echo "| ${NAMES[$i]} | not run (dry run, no GPU) | ${TARGETS[$i]} | not run |" >> "$ROWS"
  done
  echo "| total wall time | not run (dry run, no GPU) | < ${TOTAL_TARGET} s | not run |" >> "$ROWS"
  if [[ $problems -gt 0 ]]; then
    echo "Error: bench/gpu_check.sh --dry-run found $problems missing script(s) or option(s) (MISSING lines above); fix them before a GPU is lent" >&2
    exit 1
  fi
  echo "everything a real run calls is in place."
  echo
  emit "DRY RUN on CPU ($(date -u +%Y-%m-%dT%H:%MZ)): the table lists the checks a GPU run makes; nothing was measured and no GPU run has been made."
  exit 0
fi

# --- the real run ------------------------------------------------------------------------------
if ! gpu=$("$PY" -c 'import torch, sys; sys.exit("no") if not torch.cuda.is_available() else print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>&1); then
  echo "Error: bench/gpu_check.sh needs a CUDA device, and torch.cuda.is_available() is False with $PY ($(tail -n 1 <<< "$gpu")); run it on a GPU machine, or use --dry-run to list what it would run" >&2
  exit 1
fi
LOGS=$WORK/logs
[[ -n "${OUT:-}" ]] && LOGS=$OUT/gpu_check_logs
mkdir -p "$LOGS"
started=$SECONDS
for i in "${!KEYS[@]}"; do
  key=${KEYS[$i]} t=${TIMEOUTS[$i]} log=$LOGS/${KEYS[$i]}.log
  echo "[$((i + 1))/${#KEYS[@]}] $key (timeout $t s): ${CMDS[$i]}" >&2
  before=$(wc -l < "$ROWS")
  t0=$SECONDS
  eval "timeout -k 10 $t ${CMDS[$i]}" > "$log" 2>&1
  rc=$?
  echo "    exit $rc after $((SECONDS - t0)) s; log: $log" >&2
  last=$(grep -v '^\s*$' "$log" | tail -n 1 | tr '|' '/' | cut -c1-200)
  why="exited $rc"; [[ $rc == 124 || $rc == 137 ]] && why="timed out after $t s"
  if [[ $key == cuda_tests ]]; then
    result=FAIL
    if [[ $rc == 0 ]] && grep -q ' passed' <<< "$last" && ! grep -Eq 'skipped|failed|error' <<< "$last"; then result=PASS; fi
    [[ $rc == 0 || $rc == 1 ]] || last="step $why${last:+: $last}"  # pytest: 1 is failed tests, anything else is worse
    echo "| ${NAMES[$i]} | ${last:-no output} | ${TARGETS[$i]} | $result |" >> "$ROWS"
  elif [[ $rc != 0 ]]; then
    echo "| ${NAMES[$i]} | step $why: ${last:-no output} | ${TARGETS[$i]} | FAIL |" >> "$ROWS"
  elif [[ $(wc -l < "$ROWS") == "$before" ]]; then
    echo "| ${NAMES[$i]} | step wrote no result row: ${last:-no output} | ${TARGETS[$i]} | FAIL |" >> "$ROWS"
  fi
  if [[ $rc != 0 ]]; then tail -n 5 "$log" | sed 's/^/    /' >&2; fi
done
total=$((SECONDS - started))
verdict=PASS; [[ $total -lt $TOTAL_TARGET ]] || verdict=FAIL
echo "| total wall time | ${total} s | < ${TOTAL_TARGET} s | $verdict |" >> "$ROWS"
emit "GPU check on ${gpu} ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
if grep -q '| FAIL |$' "$ROWS"; then exit 1; fi
exit 0
