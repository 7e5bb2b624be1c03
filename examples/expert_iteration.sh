#!/usr/bin/env bash
# Expert iteration / ReST-EM on the bundled model and the demo task (docs/pipelines.md):
#   Grow:    sample 8 answers to each of 256 training prompts with the latest model and keep the
#            distinct ones the reward accepts (`rlvr filter --accepted`);
#   Improve: fine-tune the *base* model on that set (`rlvr sft`), as ReST-EM does, so that errors
#            do not compound across iterations; the result grows the next set.
# Then `rlvr eval` measures every iteration on the held-out prompts. About 30 minutes on 2 cores.
set -euo pipefail
tag=${1:-ei}
iterations=${2:-3}
base=builtin:smollm2-135m-instruct
model=$base
models=(--model $base)
for i in $(seq 1 "$iterations"); do
  rlvr filter --config configs/demo.toml --model "$model" --n 8 --limit 256 \
    --out runs/$tag-band-$i.jsonl --accepted runs/$tag-grown-$i.jsonl                   # Grow
  rlvr sft --config configs/sft.toml model=$base name=$tag-$i \
    sft.task_examples=0 sft.data=runs/$tag-grown-$i.jsonl sft.epochs=1                 # Improve
  model=runs/$tag-$i
  models+=(--model "$model")
done
rlvr eval --config configs/demo.toml "${models[@]}" --k 1,4,8 --n 8 --prompts 64 --out runs/$tag-eval.json
