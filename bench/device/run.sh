#!/usr/bin/env bash
# The one device call (issues 43 item 4, 42 item 5, 44): see bench/device/CALL.md.
#
#   bash bench/device/run.sh            # on the device: OUT set by the tool
#   SMOKE=1 OUT=/tmp/devout bash bench/device/run.sh   # here, tiny shapes, CPU only
#
# Sections (each bounded by `timeout`, none can fail the script):
#   A  GPU GRPO step time, 0.5B shape 8x8x256, random weights: ours full / LoRA r32 / LoRA r32
#      over NVFP4, and TRL (bench/device/section_a.py -> A.log, A.json)
#   B  peak RSS on the CPU backend, configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone, 1 RL step,
#      f32 / bf16 / LoRA r32 over nvfp4, in parallel (4 cores each) -> B.tar.gz (+ summary)
#   C  configs/vulnerability.py on the CPU until the deadline -> C.tar.gz (workdir, resumable)
# Knobs (env): SMOKE=1; DEADLINE_S (default 530: the script's end, seconds after start);
#   A_BUDGET (420: seconds for all of A); A_PER (160: at most, one A setting); A_ORDER
#   (ours_full,ours_lora,trl_gpu,ours_nvfp4); B_RUNS ('f32 bf16 nvfp4_lora'); SECTIONS (ABC:
#   which sections run); CPU_EARLY=1: start B at once on cores 4-15 with A pinned to cores 0-3
#   (B then gets the whole window; A's compile times share the host's memory bandwidth), and
#   C after A on cores 0-3. LAYOUT=parallel: A on cores 0-1, B from core 2 (4 cores a run), C on
#   the cores after B's, all three started at once. A_EXTRA: our launch flags for every ours
#   setting of A (e.g. --config.actor.micro_batch_rows=16). C_EXTRA: flags for C's launch.
set -u
T0=$(date +%s)
SMOKE=${SMOKE:-0}
DEADLINE_S=${DEADLINE_S:-530}
A_BUDGET=${A_BUDGET:-420}
CPU_EARLY=${CPU_EARLY:-0}
SECTIONS=${SECTIONS:-ABC}
A_PER=${A_PER:-160}
A_ORDER=${A_ORDER:-ours_full,ours_lora,trl_gpu,ours_nvfp4}
B_RUNS=${B_RUNS:-f32 bf16 nvfp4_lora}
LAYOUT=${LAYOUT:-}
A_EXTRA=${A_EXTRA:-}
C_EXTRA=${C_EXTRA:-}
OUT=${OUT:?OUT must be set}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
W=$(mktemp -d /tmp/devrun.XXXX)
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SUM="$OUT/summary.txt"
: >"$SUM"
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((DEADLINE_S - $(date +%s) + T0)); }
say() { echo "[$(elapsed)s] $*" | tee -a "$SUM"; }
NCPU=$(nproc)
# taskset -c LIST, or nothing where taskset is missing (then the runs share all cores).
pin() { command -v taskset >/dev/null && echo "taskset -c $1"; }

# -- 0. the environment ------------------------------------------------------------------------
if [ "$SMOKE" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$W/pip.log" 2>&1 || say "pip install of .whl FAILED: $(tail -n 3 "$W/pip.log")"
  export PYTHONPATH=/tmp/site:$ROOT
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
{
  date -u; uname -a; nproc; free -g
  nvidia-smi 2>&1 | head -20
  lscpu 2>&1 | grep -E 'Model name|^CPU\(s\)|Flags' | sed 's/Flags:/Flags:/'
  $PY - <<'EOF'
import importlib.metadata as m
for n in ("jax","jaxlib","jax-cuda13-plugin","flax","optax","orbax-checkpoint","chex","ml_collections","tensorboardX","transformers","tokenizers","torch","accelerate","trl","datasets","dill","multiprocess","pyarrow","fsspec","huggingface-hub","xxhash","pandas","psutil","numpy","safetensors","matplotlib","scipy"):
    try: print(n, m.version(n))
    except Exception as e: print(n, "MISSING")
try:
    import jax; print("jax devices:", jax.devices())
except Exception as e: print("jax devices: FAILED", e)
EOF
} >"$OUT/env.txt" 2>&1
say "env: $(grep -c MISSING "$OUT/env.txt") packages missing ($(grep MISSING "$OUT/env.txt" | tr '\n' ' ')); $(grep 'Model name' "$OUT/env.txt" | head -1 | tr -s ' ')"
say "$(grep 'jax devices' "$OUT/env.txt")"

if [ "$SMOKE" = 1 ]; then
  ARCH=tiny; SHAPE=4,2,8; STEPS=3; DEV=cpu
  B_CFG="configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone,smoke"; TINY=--tiny
  C_CFG="configs/vulnerability.py:smoke"
else
  ARCH=qwen2p5_0p5b; SHAPE=8,8,256; STEPS=4; DEV=gpu
  B_CFG="configs/qwen2p5_coder_0p5b_gsm8k.py:deadzone"; TINY=
  C_CFG="configs/vulnerability.py"
fi

# -- B and C, started in the background (functions) --------------------------------------------
B_PID=
start_b() {  # $1: the first core of B's 3 x 4 cores; runs in the background (B_PID)
  (
    c0=$1
    t=$(($(left) - 25))
    [ "$t" -lt 30 ] && { say "B: skipped ($(left) s left)"; exit 0; }
    mkdir -p "$W/B"
    # A random snapshot at the real shapes from the carried config.json + tokenizer.
    # shellcheck disable=SC2046
    timeout 180 $(pin "$c0-$((c0 + 3))") env JAX_PLATFORMS=cpu \
      $PY bench/device/make_snapshot.py .devdata/qwen05 "$W/rand05" $TINY >"$W/B/snapshot.log" 2>&1
    rc=$?
    if [ $rc != 0 ]; then
      say "B: snapshot FAILED (rc $rc; 124: timed out at 180 s): $(tail -n 2 "$W/B/snapshot.log")"
      exit 0
    fi
    say "B: $(tail -n 1 "$W/B/snapshot.log")"
    t=$(($(left) - 25))
    i=0
    for name in $B_RUNS; do
      case $name in
        f32) flags="" ;;
        bf16) flags="--config.model.dtype=bfloat16" ;;
        nvfp4_lora) flags="--config.lora.rank=32 --config.model.weight_format=nvfp4" ;;
        f32_ft) flags="--config.lora.rank=0 --config.model.dtype=float32" ;;
        bf16_ft) flags="--config.lora.rank=0 --config.model.dtype=bfloat16" ;;
        *) say "B: unknown run $name"; continue ;;
      esac
      lo=$((c0 + 4 * i)); hi=$((lo + 3))
      [ "$hi" -ge "$NCPU" ] && { lo=0; hi=$((NCPU - 1)); }
      # shellcheck disable=SC2086,SC2046
      JAX_PLATFORMS=cpu $(pin "$lo-$hi") $PY bench/device/peak_rss.py --timeout "$t" \
        --log "$W/B/$name.log" --out "$W/B/$name.json" --workdir "$W/B/run_$name" -- \
        $PY -m aqn_jax.launch --config="$B_CFG" --workdir="$W/B/run_$name" \
        --config.model.hf_path="$W/rand05" --config.data.train_path=.devdata/gsm8k/train.jsonl \
        --config.data.test_path=.devdata/gsm8k/test.jsonl --config.trainer.total_steps=1 \
        --config.trainer.val_size=1 --config.trainer.val_batch_size=1 \
        --config.checkpoint.final=none $flags >"$W/B/$name.wrapper.log" 2>&1 &
      i=$((i + 1))
    done
    say "B: $i runs started (cores from $c0, timeout $t s each)"
    wait
  ) &
  B_PID=$!
}

C_PID=
start_c() {  # $1: cores (taskset list)
  local t=$(($(left) - 35))  # SIGTERM at t (a trial saves and exits), SIGKILL 20 s later
  [ "$t" -lt 30 ] && { say "C: skipped ($(left) s left)"; return; }
  mkdir -p "$W/C"
  # shellcheck disable=SC2046
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cpu timeout -k 20 "$t" $(pin "$1") $PY -m aqn_jax.launch \
    --config="$C_CFG" --workdir="$W/C/vuln" $C_EXTRA >"$W/C/vuln.log" 2>&1 &
  C_PID=$!
  say "C: started on cores $1, timeout $t s"
}

# -- A ----------------------------------------------------------------------------------------
has() { [[ $SECTIONS == *$1* ]]; }
say "mode: SECTIONS=$SECTIONS LAYOUT=$LAYOUT CPU_EARLY=$CPU_EARLY DEADLINE_S=$DEADLINE_S A_BUDGET=$A_BUDGET A_PER=$A_PER SMOKE=$SMOKE"
A_PIN=""
EARLY=0
if [ "$LAYOUT" = parallel ] && [ "$NCPU" -ge 8 ]; then
  EARLY=2
  A_PIN=$(pin 0-1)
  nb=$(echo $B_RUNS | wc -w)
  c_lo=$((2 + 4 * nb))
  has B && start_b 2
  has C && start_c "$c_lo-$((NCPU - 1))"
elif [ "$CPU_EARLY" = 1 ] && [ "$NCPU" -ge 16 ] && has A; then
  EARLY=1
  A_PIN=$(pin 0-3)
  has B && start_b 4
fi
if has A; then
  a_t=$(($(left) - 30)); [ "$a_t" -gt "$A_BUDGET" ] && a_t=$A_BUDGET
  say "A: start (budget $a_t s${A_PIN:+, pinned: $A_PIN})"
  # shellcheck disable=SC2086
  timeout -k 10 $((a_t + 15)) $A_PIN $PY bench/device/section_a.py --arch "$ARCH" \
    --shape "$SHAPE" --steps "$STEPS" --device "$DEV" --budget "$a_t" --per-setting "$A_PER" \
    --order "$A_ORDER" --extra="$A_EXTRA" --out "$OUT/A.json" >"$OUT/A.log" 2>&1
  say "A: rc $? ($(elapsed) s)"
  grep -E '^(A |BENCH)' "$OUT/A.log" | tee -a "$SUM"
fi

# -- B and C after A --------------------------------------------------------------------------
if [ "$EARLY" = 2 ]; then
  :  # B and C started with A
elif [ "$EARLY" = 1 ]; then
  has C && start_c 0-3
elif [ "$NCPU" -ge 16 ]; then
  has B && start_b 0
  has C && start_c 12-15
else  # the local smoke: 2 cores; B and C share them
  has B && start_b 0
  has C && start_c 0-$((NCPU - 1))
fi

[ -n "$B_PID" ] && wait "$B_PID"
for name in $B_RUNS; do
  [ -f "$W/B/$name.json" ] || { [ -d "$W/B" ] && say "B $name: no result ($(tail -n 2 "$W/B/$name.wrapper.log" 2>/dev/null))"; continue; }
  $PY - "$W/B/$name.json" "$name" <<'EOF' | tee -a "$SUM"
import json, sys
r = json.load(open(sys.argv[1]))
p = r["planner_cpu_rss_gib"]
print(f"B {sys.argv[2]}: rc {r['returncode']}{' (timed out)' if r['timed_out'] else ''} after {r['wall_s']:.0f} s;"
      f" planner CPU process RSS {p if p is None else f'{p:.2f}'} GiB; measured peak RSS"
      f" {r['peak_rss_polled_gib']:.2f} GiB (polled, at {r['peak_rss_polled_at_s']:.0f} s),"
      f" ru_maxrss {r['ru_maxrss_gib'] or 0:.2f} GiB; RL steps done {r.get('rl_steps_done', 0)}"
      f" (metrics rows {r.get('metrics_rows', 0)}); last line: {(r['log_tail'] or [''])[-1][-160:]}")
EOF
done
if [ -d "$W/B" ]; then
  (cd "$W" && tar czf "$OUT/B.tar.gz" --exclude='*.safetensors' --exclude='rand05' \
    --exclude='checkpoints' B 2>/dev/null) || say "B: tar FAILED"
fi

if [ -n "$C_PID" ]; then
  wait "$C_PID"; rc=$?
  cp "$W/C/vuln.log" "$OUT/C.log" 2>/dev/null
  n_done=$(find "$W/C/vuln/runs" -name outcome.json 2>/dev/null | wc -l)
  case $rc in
    0) how="finished" ;;
    124 | 137 | 143) how="stopped at the deadline" ;;
    *) how="FAILED: $(tail -n 2 "$W/C/vuln.log" | tr '\n' ' ')" ;;
  esac
  say "C: rc $rc ($how); $n_done trials with outcome.json; report: $(ls "$W/C/vuln"/vulnerability.* 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')"
  grep -m3 -iE 'SFT warm start|warm start' "$W/C/vuln.log" "$W"/C/vuln/runs/clean/*/log.txt 2>/dev/null | head -3 | tee -a "$SUM"
  # A trial killed mid-run (no outcome.json) is dropped: here it reruns from scratch, with no
  # resume against the device's paths.
  find "$W/C/vuln/runs" -type d -name 'seed*' 2>/dev/null | while read -r d; do
    [ -f "$d/outcome.json" ] || rm -rf "$d"
  done
  (cd "$W/C" && tar czf "$OUT/C.tar.gz" --exclude='xla_cache' --exclude='*.safetensors' vuln) \
    || say "C: tar FAILED"
  sz=$(stat -c %s "$OUT/C.tar.gz" 2>/dev/null || echo 0)
  if [ "$sz" -gt 16000000 ]; then  # over what comes back: keep the outcomes and logs only
    (cd "$W/C" && find vuln -name '*.json' -o -name '*.md' >"$W/C/keep.txt" &&
      tar czf "$OUT/C.tar.gz" -T "$W/C/keep.txt")
    say "C: tar was $sz bytes; kept the outcomes and json only"
  fi
fi
say "done in $(elapsed) s; files: $(ls "$OUT" | tr '\n' ' ')"
exit 0
