#!/usr/bin/env bash
# GPU check of cod-fast, in the order a first look at a GPU needs: a profile of the trainer
# benchmark's step (fused and logits+eager), the kernel benchmark's h100 and cod-packed cases
# (today's chunk rule, then the Triton contender with the previous 512 MiB chunks), the
# train-step benchmark, the memory plan against the measured peak, the torch sampler's decode
# steps at a Qwen3-0.6B shape (compacting, static shapes, CUDA graphs), a few whole trainer
# steps in mixed precision (float32 masters, bf16 compute; their sampling time per step is the
# sampler's real workload), one on-policy distillation step if time allows, and the GPU tests
# with what time is left.
#
#   bash bench/gpu_check.sh            # from the repository root
#
# For a machine with only torch and triton installed. Pure-Python wheels the package and the
# tests need (pyyaml, rich, typer, pytest, hypothesis, ...) may wait in .whl/; they are installed
# offline into /tmp/site. Nothing is built: the C++ extension stays absent (impl `cpp` reports
# itself unavailable). Everything lands in one folder, $OUT or else gpu_check_results/: env.txt,
# profile.csv/.json with profile_<contender>.txt and .json.gz (Chrome traces), bench_<case>.log,
# kernels.csv, kernels_<case>.json, old_chunks/ (the same for the previous chunk budget),
# train.csv, decode.csv/.json, logs/ of failed benchmark workers, train_run/ and train_run.log
# (the trainer steps), teacher/, opd_run/ and opd_run.log (the distillation step), pytest.log and
# gpu_check.log (this script's whole output). Every step runs under `timeout` and is skipped
# when too little time is left, so the whole check stays under 8 minutes (GPU_CHECK_SECONDS,
# default 470, shortens it); the summary line comes last (then GPU_CHECK_BUNDLE's archive, if
# set). GPU_CHECK_CASES lists the kernel benchmark's cases as case:seconds (case@old: the
# Triton contender with 512 MiB chunks). GPU_CHECK_BENCH_ARGS adds arguments to every kernel
# benchmark call (e.g. "--scale 0.05 --impls eager,torch" for a dry run on a CPU-only machine).
set -uo pipefail

REPO=$(pwd)
OUT=${OUT:-$REPO/gpu_check_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "== cod-fast gpu_check $(date -u +%FT%TZ) repo=$REPO out=$OUT"
[ -f "$REPO/pyproject.toml" ] && [ -d "$REPO/cod_fast" ] || {
    echo "gpu_check: run from the repository root"
    exit 2
}
# Some images name their interpreter only `python3`: give it the name `python` for every step.
if ! command -v python >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
    mkdir -p /tmp/cod_fast_pybin && ln -sf "$(command -v python3)" /tmp/cod_fast_pybin/python
    export PATH=/tmp/cod_fast_pybin:$PATH
fi
unset TRITON_INTERPRET  # the GPU runs the compiled kernels, not the interpreter
# Every step's limit is cut to what is left of GPU_CHECK_SECONDS (default 470, under 8 minutes).
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-470}))
limit() {                    # limit WANTED: WANTED seconds, or what is left if that is less
    local left=$((DEADLINE - SECONDS))
    echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}
have() {                     # have NEEDED: whether NEEDED seconds are still left
    [ $((DEADLINE - SECONDS)) -ge "$1" ]
}

# 0. Offline wheels (pure Python only: --no-deps, no index).
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    timeout "$(limit 60)" python -m pip install --quiet --no-index --no-deps --upgrade \
        --target /tmp/site "$REPO"/.whl/*.whl >"$OUT/pip.log" 2>&1 ||
        echo "pip install from .whl failed (see pip.log)"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# 1. Make the package importable without building it. pyproject maps two top-level folders into
# the package (kernels/ -> cod_fast.kernels, bench/ -> cod_fast.bench), which only an install
# reproduces, and an install would build the C++ extension. Instead: a mirror of the repository
# root in a temporary folder whose entries are symlinks to the real ones, except cod_fast/, a
# real folder of symlinks to the entries of the repo's cod_fast/ plus kernels -> kernels/ and
# bench -> bench/. Python imports through symlinks, and the mirror shadows nothing as long as it
# comes first on sys.path; so every Python step runs with the mirror as its working directory
# (first on sys.path for `python -m`, and pytest's rootdir), and PYTHONPATH carries it too for
# the benchmark's worker subprocesses. Compiled leftovers (*.so) are not mirrored: nothing built
# elsewhere gets loaded here.
MIRROR=$(mktemp -d /tmp/cod_fast_mirror.XXXXXX)
trap 'rm -rf "$MIRROR"' EXIT
for entry in "$REPO"/*; do
    [ "$(basename "$entry")" = cod_fast ] || ln -s "$entry" "$MIRROR/"
done
mkdir "$MIRROR/cod_fast"
for entry in "$REPO"/cod_fast/*; do
    case "$entry" in *.so) continue ;; esac
    ln -s "$entry" "$MIRROR/cod_fast/"
done
ln -s "$REPO/kernels" "$MIRROR/cod_fast/kernels"
ln -s "$REPO/bench" "$MIRROR/cod_fast/bench"
export PYTHONPATH=$MIRROR${PYTHONPATH:+:$PYTHONPATH}
# The benchmark's CSV rows carry the commit; the copy on the GPU machine may have no .git.
COD_FAST_GIT_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
export COD_FAST_GIT_COMMIT
cd "$MIRROR" || exit 2

{
    echo "commit: $COD_FAST_GIT_COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    timeout "$(limit 60)" python - <<'EOF'
import platform

import torch

print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE (CPU only)")
import triton

print("triton", triton.__version__)
import cod_fast.bench.kernels
import cod_fast.kernels
from cod_fast.ops import dispatch

print("cod_fast from", cod_fast.kernels.__file__.rsplit("/", 2)[0])
for name, why in dispatch.available_impls().items():
    print(f"impl {name}: {why}")
EOF
} >"$OUT/env.txt" 2>&1
IMPORT_RC=$?
cat "$OUT/env.txt"
GPU=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" 2>/dev/null || echo "torch missing")

# 2. Profile of the trainer benchmark's step, fused and logits+eager (bench/profile_step.py):
# device-busy share, kernels and syncs per step, top ops by device and host time, and a Chrome
# trace of each (profile_*.json.gz).
PROFILE="profile not run"
if [ "$IMPORT_RC" -eq 0 ] && have 20; then
    lim=$(limit 45)
    echo "== profile of the train step (limit $lim s)"
    timeout --kill-after=5 "$lim" python -m cod_fast.bench.profile_step --steps 3 --out "$OUT" \
        2>&1 | tee "$OUT/bench_profile.log"
    PROFILE="profile rc=${PIPESTATUS[0]}"
fi

# 3. Kernel benchmark, one invocation per case so that each case has its own time limit (the CSV
# gets a row as each contender finishes, so a timeout loses only the unfinished one): first with
# today's settings, then the Triton contender alone with the previous chunk budget (512 MiB,
# COD_FAST_CHUNK_MIB) into old_chunks/, the old-vs-new comparison of the chunk rule.
BENCH=()
CSV_START=$(wc -l <"$OUT/kernels.csv" 2>/dev/null || echo 0)  # rows before this check's
if [ "$IMPORT_RC" -eq 0 ]; then
    for spec in ${GPU_CHECK_CASES:-h100:75 cod-packed:35 h100@old:35 cod-packed@old:20}; do
        case_name=${spec%%:*}
        wanted=${spec##*:}
        have 10 || break
        lim=$(limit "$wanted")
        out=$OUT chunk_mib="" extra=()
        if [ "${case_name#*@}" = old ]; then
            case_name=${case_name%@old} out=$OUT/old_chunks chunk_mib=512 extra=(--impls triton)
        fi
        echo "== benchmark $case_name ${extra[*]} -> $out (limit $lim s)"
        mkdir -p "$out"
        rm -f "$out/kernels.json"
        COD_FAST_CHUNK_MIB=$chunk_mib timeout --kill-after=5 "$lim" python -m cod_fast.bench.kernels \
            --cases "$case_name" "${extra[@]}" --reps 3 --warmup 1 --timeout 100 --out "$out" \
            ${GPU_CHECK_BENCH_ARGS:-} 2>&1 | tee "$out/bench_$case_name.log"
        rc=${PIPESTATUS[0]}
        [ -f "$out/kernels.json" ] && mv "$out/kernels.json" "$out/kernels_$case_name.json"
        BENCH+=("${spec%%:*}:rc=$rc")
    done
fi

# 3b. One training step (fused loss vs logits + eager loss) of the 4-layer Qwen3-shaped model,
# bf16 with torch's varlen attention (bench/train.py).
TRAIN="train bench not run"
if [ "$IMPORT_RC" -eq 0 ] && have 20; then
    lim=$(limit 45)
    echo "== benchmark train step (limit $lim s)"
    timeout --kill-after=5 "$lim" python -m cod_fast.bench.train --sections step --reps 3 \
        --warmup 1 --out "$OUT" 2>&1 | tee "$OUT/bench_train.log"
    TRAIN="train bench rc=${PIPESTATUS[0]}"
fi

# 3b'. The memory plan (`cod-fast plan`) against torch.cuda.max_memory_allocated of the 29M
# model's training step and of two torch-sampler rollouts, float32 (bench/plan.py).
PLAN="plan check not run"
if [ "$IMPORT_RC" -eq 0 ] && have 20; then
    lim=$(limit 40)
    echo "== memory plan vs measured (limit $lim s)"
    timeout --kill-after=5 "$lim" python -m cod_fast.bench.plan --device cuda --shape 29m \
        --out "$OUT" 2>&1 | tee "$OUT/bench_plan.log"
    PLAN="plan check rc=${PIPESTATUS[0]}"
fi

# 3c. Decode steps of the torch sampler at a Qwen3-0.6B shape, batch 32 and 128: dropping
# finished rows vs static shapes vs static shapes replayed as CUDA graphs (bench/decode.py).
DECODE="decode bench not run"
if [ "$IMPORT_RC" -eq 0 ] && have 20; then
    lim=$(limit 75)
    echo "== benchmark decode (limit $lim s)"
    timeout --kill-after=5 "$lim" python -m cod_fast.bench.decode --batches 32,128 \
        --new-tokens 32 --reps 2 --out "$OUT" 2>&1 | tee "$OUT/bench_decode.log"
    DECODE="decode bench rc=${PIPESTATUS[0]}"
fi

# 3d. Whole trainer steps, sampling included, of a Qwen3-architecture model built from a config
# (8 layers, H=1024, bf16 compute on float32 masters: FSDP2's mixed precision on a one-rank
# mesh; torch's varlen attention; the torch sampler: vLLM is not installed on this machine).
# Evaluation runs keyed and split over the ranks (one here). tokens/s per GPU = training tokens
# / step wall time / GPUs, from metrics.jsonl; the checkpoint must hold float32 masters.
STEPS="trainer not run"
if [ "$IMPORT_RC" -eq 0 ] && have 40; then
    lim=$(limit 70)
    echo "== trainer steps (limit $lim s)"
    rm -rf "$OUT/train_run"
    timeout --kill-after=5 "$lim" python -m cod_fast.cli train --preset tiny-cpu \
        --set runtime.device=cuda --set model.dtype=bfloat16 --set model.hidden_size=1024 \
        --set model.num_layers=8 --set model.num_heads=8 --set model.intermediate_size=3072 \
        --set train.warm_start_steps=0 --set train.steps=4 --set rollout.eval_packs=4 \
        --set runtime.run_dir="$OUT/train_run" >"$OUT/train_run.log" 2>&1
    rc=$?
    tail -n 30 "$OUT/train_run.log"
    STEPS="trainer rc=$rc $(
        python - "$OUT/train_run" <<'EOF' 2>/dev/null
import json
import statistics
import sys

from cod_fast.checkpoint import latest_checkpoint, read_model_state

rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")][1:]  # 1st: warm-up
med = lambda key: statistics.median(r[key] for r in rows)
ckpt = latest_checkpoint(sys.argv[1])
masters = sorted({str(t.dtype) for t in read_model_state(ckpt).values()})
print(f"{med('tokens_per_s_per_device'):.0f} tokens/s/GPU (sample {med('sample_s'):.2f} s, "
      f"train {med('train_s'):.2f} s per step, {len(rows)} steps; compute "
      f"{ckpt.extra.get('compute_dtype')}, masters {','.join(masters)})")
EOF
    )"
fi

# 3e. On-policy distillation on the GPU: the trainer steps' model exported as a bf16 teacher,
# then one opd step of a student with that run's tokenizer; the teacher is loaded for the GPU
# (its dtype and attention kernel), whether it stays there or waits in host memory.
OPD="opd not run"
if [ "$IMPORT_RC" -eq 0 ] && [ -f "$OUT/train_run/checkpoints/latest" ] && have 90; then
    lim=$(limit 40)
    echo "== distillation step (limit $lim s)"
    rm -rf "$OUT/teacher" "$OUT/opd_run"
    timeout --kill-after=5 "$lim" bash -c '
        python -m cod_fast.cli export "$1/train_run" --out "$1/teacher" &&
        python -m cod_fast.cli train --preset tiny-cpu --set runtime.device=cuda \
            --set model.dtype=bfloat16 --set model.tokenizer_path="$1/train_run/tokenizer" \
            --set algo.loss.policy=opd --set "algo.teachers={frozenlake: $1/teacher}" \
            --set train.warm_start_steps=0 --set train.steps=1 --set rollout.eval_packs=2 \
            --set runtime.run_dir="$1/opd_run"' _ "$OUT" >"$OUT/opd_run.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/opd_run.log"
    OPD="opd rc=$rc $(
        python - "$OUT/opd_run/metrics.jsonl" <<'EOF' 2>/dev/null
import json
import sys

last = json.loads(open(sys.argv[1]).read().splitlines()[-1])
print(f"teacher_gap {last.get('teacher_gap')}, teacher_s {last.get('teacher_s')}")
EOF
    )"
fi

# 4. GPU tests, with what time is left (only the files present; pytest comes from .whl/ when the
# machine lacks it).
TESTS=()
for t in tests/ops/test_triton_kernels.py tests/ops/test_chunking.py tests/rollout/test_static_decode.py \
    tests/ops/test_policy_loss.py tests/model/test_attention.py tests/rollout/test_torch_sampler.py \
    tests/rollout/test_fast_decode.py tests/ops/test_host_syncs.py tests/model/test_lean.py; do
    [ -f "$t" ] && TESTS+=("$t")
done
if [ "$IMPORT_RC" -ne 0 ]; then
    PYTEST="not run (imports failed, see env.txt)"
elif ! python -c "import pytest" 2>/dev/null; then
    PYTEST="not run (pytest not installed; put its wheels in .whl/)"
elif [ "${#TESTS[@]}" -eq 0 ]; then
    PYTEST="not run (no test files)"
else
    echo "== pytest ${TESTS[*]}"
    lim=$(limit 120)
    timeout --kill-after=5 "$lim" python -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
        --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
    rc=${PIPESTATUS[0]}
    last=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$OUT/pytest.log" | tail -n 1)
    [ "$rc" -eq 124 ] && last="timed out after $lim s; $last"
    PYTEST="rc=$rc ${last//=/}"
fi

# 5. One-line summary from the CSV rows of this check.
SUMMARY=$(
    python - "$OUT/kernels.csv" "$CSV_START" <<'EOF' 2>/dev/null
import csv
import sys

try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    lines = []
start = max(int(sys.argv[2]), 1)  # skip the header and the rows of earlier checks
rows = list(csv.DictReader(lines[:1] + lines[start:]))
ok = [r for r in rows if r["note"] == "ok"]
parts = [f"bench {len(ok)}/{len(rows)} rows ok"]
for r in ok:
    if r["contender"] == "triton":
        x = r["speedup_vs_eager"] and f"{float(r['speedup_vs_eager']):.1f}x eager"
        parts.append(f"{r['case']} triton {float(r['median_s']) * 1e3:.0f} ms ({x or '?'})")
print("; ".join(parts))
EOF
)
echo "gpu_check: ${GPU} | ${PROFILE} | ${BENCH[*]:-bench not run} | ${TRAIN} | ${PLAN} | ${DECODE} | ${STEPS} | ${OPD} | pytest ${PYTEST} | ${SUMMARY:-no CSV} | out ${OUT}"

# 6. Optionally one archive of everything but the trainer's checkpoints (a device that hands back
# only a few small files: OUT=/tmp/gc GPU_CHECK_BUNDLE=$OUT_OF_THE_DEVICE/gpu_check.tgz).
if [ -n "${GPU_CHECK_BUNDLE:-}" ]; then
    tar czf "$GPU_CHECK_BUNDLE" --exclude=checkpoints -C "$(dirname "$OUT")" "$(basename "$OUT")" &&
        echo "gpu_check: bundle $GPU_CHECK_BUNDLE ($(du -h "$GPU_CHECK_BUNDLE" | cut -f1))"
fi
