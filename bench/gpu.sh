#!/usr/bin/env bash
# Issue 20's GPU checks in one call of the device tool (docs/performance.md, the H200 section):
#   1. bench/gpu.py: the engine's agreement with HF on CUDA, every method's update against the
#      CPU's, and the engine's and learner's speed on
#      random-weight SmolLM2-135M, Qwen2-0.5B and Qwen2-1.5B shapes against HF `generate`;
#   2. `rlvr train` end to end with train.device=cuda: on-policy distillation of one random
#      SmolLM2-shaped model into another on the demo task (prints the reverse KL per step);
#   3. bench/multiturn.py on guess_number with train.device=cuda: multi-turn episodes with each
#      turn's context prefilled whole against reusing the stored prefixes, fresh processes;
#   4. issue 51: sharded learners (FSDP2) over NCCL on the GPU, without Ray (bench/fsdp_check.py:
#      the gathered weights after 3 updates against the unsharded learner's, and both times), on
#      a random-weight SmolLM2 shape and on Qwen2-0.5B's (bench/gpu.py make-model);
#   5. issue 57: `rlvr bench --parts rm`: the reward_model reward's throughput on the GPU, fp32
#      and bf16, a whole step in one call against one call a prompt (unmeasured on a GPU so far);
#   6. issue 51: if the machine has vLLM (it cannot be carried: its wheel is far over the 64 MiB
#      carry, and the machine has no network), the engine contract tests and the vLLM tests on
#      CUDA vLLM; else a line saying so. Likewise Ray, which sharded learners in `rlvr train` need.
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
for shape in smollm2-135m qwen2-0.5b; do
  python3 bench/gpu.py make-model /tmp/fsdp_$shape --tokenizer .gpu/tok --seed 3 --shape $shape 2>&1 | grep -v -i warn
  timeout "${FSDP_S:-120}" python3 bench/fsdp_check.py --device cuda --world 1 --model /tmp/fsdp_$shape 2>&1 \
    | grep -v -i warn | tee "$OUT/fsdp_$shape.json"
done
timeout "${RM_S:-120}" python3 -m rlvr.cli bench --parts rm --model /tmp/student 2>&1 | grep -v -i warn \
  | tee "$OUT/rm_bench.json"
if python3 -c "import vllm" 2>/dev/null; then
  RLVR_REQUIRE_VLLM=1 timeout "${VLLM_S:-240}" python3 -m pytest -x -q -m vllm tests/test_engine_contract.py tests/test_vllm.py \
    2>&1 | tail -15 | tee "$OUT/vllm_tests.log"
else
  echo "vLLM is not installed on this machine: the CUDA vLLM tests did not run" | tee "$OUT/vllm_tests.log"
fi
python3 -c "import ray" 2>/dev/null || echo "Ray is not installed on this machine: rlvr train with dist.* did not run"
