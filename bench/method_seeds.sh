#!/usr/bin/env bash
# Three seeds of a method against GRPO on the demo, each followed by `rlvr eval` (pass@k) on its
# final model: the issue 22 comparison. Usage:
#   bash bench/method_seeds.sh OUT_DIR LABEL [overrides...]
# e.g. bash bench/method_seeds.sh /tmp/seeds sapo algo.loss=sapo algo.aggregation=seq-mean-token-mean
# Writes OUT_DIR/LABEL-seedS/ (the run) and OUT_DIR/LABEL-seedS.eval.json (pass@1,4,8 over 8 samples,
# on that seed's own held-out prompts). LABEL "base" evaluates the bundled model without training.
set -euo pipefail
out=$1; label=$2; shift 2
mkdir -p "$out"
for seed in ${SEEDS:-0 1 2}; do
  run="$out/$label-seed$seed"
  [ -f "$out/$label-seed$seed.eval.json" ] && continue
  if [ "$label" = base ]; then
    rlvr eval --model builtin:smollm2-135m-instruct --config configs/demo.toml --k 1,4,8 --n 8 --seed 0 \
      --out "$out/base-seed$seed.eval.json" seed=$seed
    continue
  fi
  rm -rf "$run"
  rlvr train --config configs/demo.toml seed=$seed train.eval_every=5 output_dir="$out" name="$label-seed$seed" "$@"
  rlvr eval --model "$run" --config configs/demo.toml --k 1,4,8 --n 8 --seed 0 --out "$out/$label-seed$seed.eval.json" seed=$seed
done
