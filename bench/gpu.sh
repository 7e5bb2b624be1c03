#!/usr/bin/env bash
# Issue 20's GPU checks in one call of the device tool (docs/performance.md, the H200 section):
#   1. bench/gpu.py: the engine's agreement with HF on CUDA, every method's update against the
#      CPU's, and the engine's and learner's speed on
#      random-weight SmolLM2-135M, Qwen2-0.5B and Qwen2-1.5B shapes against HF `generate`;
#   2. `rlvr train` end to end with train.device=cuda: on-policy distillation of one random
#      SmolLM2-shaped model into another on the demo task (prints the reverse KL per step);
#   3. bench/multiturn.py on guess_number with train.device=cuda: multi-turn episodes with each
#      turn's context prefilled whole against reusing the stored prefixes, fresh processes.
# The machine has torch and transformers but not rlvr's other dependencies, nor the bundled model:
# .gpu/site holds those packages' files and .gpu/tok the bundled model's tokenizer (made on the
# development machine, see the LOG), carried with the call. Writes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/.gpu/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
timeout "${BENCH_S:-300}" python3 bench/gpu.py --parts "${PARTS:-agreement,graphs,prefixes,methods,engine,learner}" ${GPU_ARGS:-} --out "$OUT/gpu.json" 2>&1 | grep -v -i warn | tee "$OUT/gpu.log"
python3 bench/gpu.py make-model /tmp/student --tokenizer .gpu/tok --seed 1 2>&1 | grep -v -i warn
python3 bench/gpu.py make-model /tmp/teacher --tokenizer .gpu/tok --seed 2 2>&1 | grep -v -i warn
timeout "${TRAIN_S:-150}" python3 -m rlvr.cli train --config configs/demo.toml model=/tmp/student \
  algo.advantage=opd 'algo.advantage_kwargs={teacher="/tmp/teacher"}' train.device=cuda train.steps=8 \
  task.eval_size=16 output_dir=/tmp/runs name=opd > "$OUT/train.log" 2>&1
echo "train rc=$?"; grep -E "^(step|done)|Error|error" "$OUT/train.log" | tail -12
cp /tmp/runs/opd/metrics.jsonl "$OUT/opd_metrics.jsonl" 2>/dev/null
python3 - "$OUT/opd_metrics.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(r["step"], "kl", round(r["opd/reverse_kl"], 4), "mismatch", f'{r["mismatch_logratio_abs"]:.2e}',
          "gen_s", round(r["generate_seconds"], 2), "train_s", round(r["train_seconds"], 2))
PY
timeout "${MULTITURN_S:-150}" python3 bench/multiturn.py configs/guess_number.toml --steps 3 model=/tmp/student \
  train.device=cuda 2>&1 | grep -v -i warn | tee "$OUT/multiturn.log"
