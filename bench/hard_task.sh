#!/usr/bin/env bash
# Issue 22's harder comparison: chain_sum with 3 terms of 1-2 digits (the bundled model starts near
# 19% greedy), each method trained for 15 minutes of step time (train.max_minutes; evaluations
# excluded), three seeds, held-out accuracy every 5 steps and pass@k at the end. Usage:
#   bash bench/hard_task.sh OUT_DIR LABEL [overrides...]
# e.g. bash bench/hard_task.sh /tmp/hard kl_cov algo.loss=kl_cov
# Run one at a time with nothing else on the machine: the budget is wall-clock, so two runs side by
# side would each get half the CPU. Tabulate with python bench/method_table.py OUT_DIR.
set -euo pipefail
out=$1; label=$2; shift 2
task=(task.params="{min_terms = 3, max_terms = 3, min_digits = 1, max_digits = 2}")
budget=(train.steps=1000 train.max_minutes=${MINUTES:-15} train.eval_every=5)
mkdir -p "$out"
for seed in ${SEEDS:-0 1 2}; do
  [ -f "$out/$label-seed$seed.eval.json" ] && continue
  rm -rf "$out/$label-seed$seed"
  rlvr train --config configs/demo.toml seed=$seed output_dir="$out" name="$label-seed$seed" "${task[@]}" "${budget[@]}" "$@"
  rlvr eval --model "$out/$label-seed$seed" --config configs/demo.toml --k 1,4,8 --n 8 --seed 0 \
    --out "$out/$label-seed$seed.eval.json" seed=$seed "${task[@]}"
done
