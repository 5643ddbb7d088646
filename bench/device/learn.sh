#!/usr/bin/env bash
# The GPU learning run (issue 49 item 3): Qwen2.5-Coder-0.5B's GGUF carried in parts, GRPO on
# GSM8K in QeRL mode (LoRA r32, bf16), a faulty arm and a clean-device control side by side on
# one GPU. The exact calls: bench/device/CALL.md, "The learning run".
#
#   bash bench/device/learn.sh take K      # part call K: check part K of .parts/, move it to $PARTS
#   bash bench/device/learn.sh run         # the run call: check all, import, two arms, pack $OUT
#   bash bench/device/learn.sh study       # the study (issue 59) on the GPU: the four arms of
#                                          # configs/qwen2p5_coder_0p5b_gsm8k.py:study,arith side by
#                                          # side, one compare job an arm over SEEDS; resumable:
#                                          # call it again while the machine is warm
#   # here, the CPU dry run (tests/test_device_parts.py):
#   SMOKE=1 LAYERS=2 OUT=/tmp/o PARTS=/tmp/p PY=python bash bench/device/learn.sh run
#
# Knobs (env): PARTS (/root/parts: where the part calls put the parts), SRC (.parts: the carried
#   set), DATA (.devdata/gsm8k: train.jsonl, test.jsonl), DEADLINE_S (420: the run call's end,
#   seconds after its start; the arms get SIGTERM 40 s before it, save and stop), ARMS
#   ('deadzone clean'), CFG (configs/qwen2p5_coder_0p5b_gsm8k.py), VARIANT (gpu), MEMFRAC
#   (0.45: XLA_PYTHON_CLIENT_MEM_FRACTION of each arm), EXTRA (launch flags for every arm),
#   PACK_EVERY (30 s), ADAPTER_ARM (deadzone: whose adapters come back; both would be 70 MB,
#   over the 64 MiB that comes back), SMOKE=1 (CPU, the config's ',smoke', no wheels) with
#   LAYERS=N (the imported snapshot cut to its first N layers); SNAP (where the import goes).
# $OUT (at most 8 files): summary.txt, setup.tgz (env, parts check, import log and record),
#   <arm>.tgz per arm (the workdir without checkpoints: metrics.jsonl, summary.json, log),
#   adapter/ (manifest.json + 3 parts of the faulty arm's latest adapters, bf16).
# `study` differs: ARMS ('deadzone clean targeted global_aqn'), VARIANT (study,arith), SEEDS
#   ('(0,1,2,3,4)'), MEMFRAC (0.2), each arm's compare job in WORK/<arm> (/root/study: kept for
#   a second call, which resumes) and SNAP (/root/snapshot: imported once, reused while its
#   sha256 is the parts'); the first arm evaluates step 0, the targeted arm runs SRDD. $OUT:
#   summary.txt, setup.tgz, runs.tgz (every arm's workdir without checkpoints and caches, and
#   logs/<arm>.log: the launch output of every call) and
#   study.json, study.png, study.md (python -m aqn_jax.study.outcome over the arms merged, its
#   arms and comparisons from --config="$CFG:$VARIANT").
set -u
T0=$(date +%s)
MODE=${1:?usage: learn.sh take K | learn.sh run | learn.sh study}
OUT=${OUT:?OUT must be set}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PY:-python3}
PARTS=${PARTS:-/root/parts}
SRC=${SRC:-.parts}
SMOKE=${SMOKE:-0}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$MODE" = take ]; then
  K=${2:?usage: learn.sh take K}
  $PY bench/device/parts.py take --dir="$SRC" --part="$K" --to="$PARTS" || exit 1
  echo "take $K: $(($(date +%s) - T0)) s; $(df -h "$PARTS" | tail -1 | tr -s ' ')"
  exit 0
fi
case "$MODE" in
  run | study) ;;
  *) echo "learn.sh: mode '$MODE'; allowed: take K | run | study" >&2; exit 2 ;;
esac

DATA=${DATA:-.devdata/gsm8k}
DEADLINE_S=${DEADLINE_S:-420}
CFG=${CFG:-configs/qwen2p5_coder_0p5b_gsm8k.py}
if [ "$MODE" = study ]; then
  ARMS=${ARMS:-deadzone clean targeted global_aqn}
  VARIANT=${VARIANT:-study,arith}
  SEEDS=${SEEDS:-(0,1,2,3,4)}
  MEMFRAC=${MEMFRAC:-0.2}
  WORK=${WORK:-/root/study}
  SNAP=${SNAP:-/root/snapshot}
else
  ARMS=${ARMS:-deadzone clean}
  VARIANT=${VARIANT:-gpu}
  MEMFRAC=${MEMFRAC:-0.45}
fi
EXTRA=${EXTRA:-}
PACK_EVERY=${PACK_EVERY:-30}
ADAPTER_ARM=${ADAPTER_ARM:-deadzone}
W=$(mktemp -d /tmp/learn.XXXX)
trap 'rm -rf "$W"' EXIT  # what matters is in $OUT (and SNAP, where set)
WORK=${WORK:-$W}  # the arms' workdirs (`study`: kept for the next call)
LOGS=$W  # each arm's launch output (`study`: WORK/logs, appended by every call)
[ "$MODE" = study ] && LOGS=$WORK/logs
mkdir -p "$LOGS"
mkdir -p "$OUT" "$W/setup"
SUM="$OUT/summary.txt"
: >"$SUM"
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((DEADLINE_S - $(date +%s) + T0)); }
say() { echo "[$(elapsed)s] $*" | tee -a "$SUM"; }
pack_setup() { tar czf "$W/setup.tgz" -C "$W" setup && mv "$W/setup.tgz" "$OUT/setup.tgz"; }

# -- 0. the environment: wheels for what the image lacks (gguf, ml_collections, tensorboardX) --
if [ "$SMOKE" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$W/setup/pip.log" 2>&1 || say "pip install FAILED: $(tail -n 2 "$W/setup/pip.log")"
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
{
  date -u; nproc; free -g; nvidia-smi 2>&1 | head -15
  lscpu 2>&1 | grep -E 'Model name|^CPU\(s\)'
  $PY -c "import importlib.metadata as m
for n in ('jax','jaxlib','flax','optax','orbax-checkpoint','ml_collections','tensorboardX','gguf','transformers','torch','safetensors','numpy'):
    try: print(n, m.version(n))
    except Exception: print(n, 'MISSING')"
} >"$W/setup/env.txt" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
DEVICE="${gpu:-no GPU}; host $(lscpu 2>/dev/null | grep 'Model name' | sed 's/.*: *//' | head -n 1)"
say "mode: SMOKE=$SMOKE ARMS='$ARMS' VARIANT=$VARIANT DEADLINE_S=$DEADLINE_S MEMFRAC=$MEMFRAC; $(grep -c MISSING "$W/setup/env.txt") packages missing $(grep MISSING "$W/setup/env.txt" | tr '\n' ' ')"

# -- 1. the import's own tests under this machine's transformers (its special tokens: issue 69),
# the parts all there and intact, then the import on the CPU ---------------------------------------
if [ "$SMOKE" != 1 ]; then
  t=$(date +%s)
  JAX_PLATFORMS=cpu $PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_gguf.py \
    >"$W/setup/test_gguf.log" 2>&1
  rc=$?
  say "tests/test_gguf.py (not slow): rc $rc, $(tail -n 1 "$W/setup/test_gguf.log") ($(($(date +%s) - t)) s)"
  if [ $rc != 0 ]; then
    grep -E '^(FAILED|ERROR)' "$W/setup/test_gguf.log" | head -n 5 | while read -r l; do say "  $l"; done
    pack_setup
    exit 1
  fi
fi
if ! $PY bench/device/parts.py check --dir="$PARTS" >"$W/setup/parts.log" 2>&1; then
  say "parts: $(tail -n 1 "$W/setup/parts.log")"
  pack_setup
  exit 1
fi
say "parts: $(tail -n 1 "$W/setup/parts.log")"
SNAP=${SNAP:-$W/snapshot}  # the imported HF snapshot (kept where SNAP says)
sha=$($PY bench/device/parts.py sha256 --dir="$PARTS")
t=$(date +%s)
if [ -f "$SNAP/gguf_import.json" ] && grep -q "\"$sha\"" "$SNAP/gguf_import.json"; then
  cp "$SNAP/gguf_import.json" "$W/setup/"
  say "import: reused $SNAP (the parts' sha256)"
else
  rm -rf "$SNAP" "$SNAP-${LAYERS:-}"
  JAX_PLATFORMS=cpu $PY -m aqn_jax.models.gguf --gguf="$($PY bench/device/parts.py paths --dir="$PARTS")" \
    --sha256="$sha" --out="$SNAP" >"$W/setup/import.log" 2>&1
  rc=$?
  cp "$SNAP/gguf_import.json" "$W/setup/" 2>/dev/null
  if [ $rc != 0 ]; then
    say "import FAILED (rc $rc): $(grep -E '^error' "$W/setup/import.log" | tail -n 1)"
    rm -rf "$SNAP"  # never reused half-written
    pack_setup
    exit 1
  fi
  say "import: $(tail -n 1 "$W/setup/import.log") (wall $(($(date +%s) - t)) s)"
fi
if [ "$SMOKE" = 1 ] && [ -n "${LAYERS:-}" ]; then
  if [ ! -f "$SNAP-$LAYERS/config.json" ]; then
    $PY bench/device/make_snapshot.py "$SNAP" "$SNAP-$LAYERS" --first-layers="$LAYERS" >>"$W/setup/import.log" 2>&1 || { say "cut to $LAYERS layers FAILED"; exit 1; }
  fi
  SNAP=$SNAP-$LAYERS
fi
pack_setup

# -- 2. the arms, side by side, each SIGTERMed (a last checkpoint) 40 s before the deadline ------
variant=$VARIANT
[ "$SMOKE" = 1 ] && variant="$VARIANT,smoke"
platform=()
[ "$SMOKE" = 1 ] && platform=(JAX_PLATFORMS=cpu)
n=$(echo $ARMS | wc -w)
ncpu=$(nproc)
per=$((ncpu / n)); [ "$per" -lt 1 ] && per=1
i=0
PIDS=()
for arm in $ARMS; do
  t=$(($(left) - 40))
  [ "$t" -lt 30 ] && { say "$arm: not started ($(left) s left)"; continue; }
  pin=()
  if [ "$ncpu" -ge $((2 * n)) ] && command -v taskset >/dev/null; then
    pin=(taskset -c "$((i * per))-$((i * per + per - 1))")
  fi
  if [ "$MODE" = study ]; then  # the arm's compare job: its seeds, step 0 by the first arm
    first=False; [ "$i" = 0 ] && first=True
    # One arm per job: no comparison inside it (the outcome pairs the jobs' runs).
    args=(--config="$CFG:$variant" "--config.compare.arms=('$arm',)" "--config.compare.seeds=$SEEDS"
      "--config.compare.comparisons=()" "--config.compare.clean_comparisons=()"
      "--config.compare.reference_arm=$arm" --config.compare.baseline=$first)
  else
    args=(--config="$CFG:$arm,$variant" --config.data.train_path="$DATA/train.jsonl"
      --config.data.test_path="$DATA/test.jsonl")
  fi
  # shellcheck disable=SC2086
  env "${platform[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION="$MEMFRAC" timeout -s TERM -k 30 "$t" \
    "${pin[@]}" $PY -m aqn_jax.launch "${args[@]}" --workdir="$WORK/$arm" \
    --config.model.hf_path="$SNAP" $EXTRA >>"$LOGS/$arm.log" 2>&1 &
  PIDS+=($!)
  say "$arm: started (${args[*]}; SIGTERM at $t s${pin:+, ${pin[*]}})"
  i=$((i + 1))
done

pack_study() {  # every arm's workdir (no checkpoints, caches) and the outcome so far -> $OUT
  local m=$W/merged arm
  rm -rf "$m" && mkdir -p "$m/runs"
  for arm in $ARMS; do
    [ -d "$WORK/$arm/runs/$arm" ] && ln -s "$WORK/$arm/runs/$arm" "$m/runs/$arm"
    [ -d "$WORK/$arm/baseline" ] && [ ! -e "$m/baseline" ] && ln -s "$WORK/$arm/baseline" "$m/baseline"
    [ -d "$WORK/$arm/srdd" ] && [ ! -e "$m/srdd" ] && ln -s "$WORK/$arm/srdd" "$m/srdd"
  done
  # shellcheck disable=SC2086
  tar czf "$W/runs.tgz" -C "$WORK" --exclude=checkpoints --exclude=xla_cache --exclude=cache \
    --exclude='*.lock' $(cd "$WORK" && ls -d logs $ARMS 2>/dev/null) && mv "$W/runs.tgz" "$OUT/runs.tgz"
  if [ -f "$m/baseline/evaluation.json" ]; then
    # The merged workdir has no config.json (each arm's job wrote its own): the study's
    # arms, names and comparisons come from the config the arms were launched with.
    $PY -m aqn_jax.study.outcome --workdir="$m" --out="$W/study" --cpu="$DEVICE" \
      --config="$CFG:$variant" \
      >"$W/outcome.log" 2>&1 && mv "$W"/study.{json,png,md} "$OUT/"
  fi
}

pack() {  # what the arms have so far -> $OUT, each file replaced whole
  [ "$MODE" = study ] && { pack_study; return; }
  for arm in $ARMS; do
    [ -d "$W/$arm" ] || continue
    cp "$W/$arm.log" "$W/$arm/launch.log" 2>/dev/null
    tar czf "$W/$arm.tgz" -C "$W" --exclude=checkpoints --exclude=xla_cache --exclude='*.lock' \
      "$arm" && mv "$W/$arm.tgz" "$OUT/$arm.tgz"
  done
  if [ -d "$W/$ADAPTER_ARM/checkpoints" ]; then
    local step
    step=$(ls "$W/$ADAPTER_ARM/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1)
    if [ -n "$step" ] && [ "$step" != "${PACKED_STEP:-}" ]; then
      JAX_PLATFORMS=cpu $PY bench/device/learn_pack.py adapter "$W/$ADAPTER_ARM" "$W/adapter" \
        >"$W/adapter.log" 2>&1 && rm -rf "$OUT/adapter" && cp -r "$W/adapter" "$OUT/adapter" \
        && PACKED_STEP=$step
    fi
  fi
}

while :; do
  alive=0
  for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  sleep "$PACK_EVERY" & wait $!
  pack
done
for j in "${!PIDS[@]}"; do
  wait "${PIDS[$j]}"; rc=$?
  arm=$(echo $ARMS | cut -d' ' -f$((j + 1)))
  err=$(tail -n 40 "$LOGS/$arm.log" | grep -E 'Error|error:' | tail -n 1)
  say "$arm: rc $rc$([ $rc = 124 ] && echo ' (stopped at its deadline)')${err:+; $err}"
done
pack
if [ "$MODE" = study ]; then
  if [ -f "$OUT/study.md" ]; then
    say "outcome: $(tail -n 1 "$W/outcome.log")"
    tee -a "$SUM" <"$OUT/study.md"
  else
    say "outcome: none yet ($(tail -n 1 "$W/outcome.log" 2>/dev/null || echo 'no step-0 evaluation'))"
  fi
else
  say "adapter ($ADAPTER_ARM): $(tail -n 1 "$W/adapter.log" 2>/dev/null || echo none)"
  $PY bench/device/learn_pack.py summary $(for a in $ARMS; do echo "$W/$a"; done) | tee -a "$SUM"
fi
say "done in $(elapsed) s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
exit 0
