#!/usr/bin/env bash
# Issue 53's comparison on the hard task (chain_sum, 3 terms of 1-2 digits): one run of LABEL at
# SEED for MINUTES of step time (train.max_minutes, default 30), then `rlvr eval` of the bundled
# model and the run, side by side on the same 64 held-out target prompts: greedy accuracy with its
# paired 95% interval (OUT/RUN.eval.json and .md), and, with PASSK=1, pass@1/4/8 at temperature 1
# (OUT/RUN.passk.json). Runs print nothing until they end; their logs are OUT/RUN.log, RUN being
# LABEL-seedSEED. Usage:
#   bash bench/hard_recipe.sh OUT LABEL SEED [--config CONFIG] [overrides...]
# e.g. bash bench/hard_recipe.sh /tmp/h53 relift 0 'expert.mode="relift"' 'expert.template="{expression} = {answer}"'
# --config (first, if given) replaces configs/demo.toml as the training config, which then sets its
# own task; the evaluation always uses the demo's instruction and reward on the target task. Runs
# may share the machine, one thread each (OMP_NUM_THREADS=1 unless set); start them together so
# that each meets the same load. The LOG's tables (session 27) were read from the .md files.
set -euo pipefail
out=$1; label=$2; seed=$3; shift 3
config=configs/demo.toml
if [ "${1:-}" = --config ]; then config=$2; shift 2; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
target=(task.params="{min_terms = 3, max_terms = 3, min_digits = 1, max_digits = 2}")
run="$label-seed$seed"
mkdir -p "$out"
[ -f "$out/$run.eval.json" ] && exit 0
rm -rf "${out:?}/$run"
{
  if [ "$config" = configs/demo.toml ]; then set -- "${target[@]}" "$@"; fi
  rlvr train --config "$config" seed="$seed" output_dir="$out" name="$run" train.steps=100000 \
    train.max_minutes="${MINUTES:-30}" task.eval_size=0 "$@"
  both=(--model builtin:smollm2-135m-instruct --model "$out/$run" --config configs/demo.toml --prompts 64 --seed 0)
  if [ "${PASSK:-0}" = 1 ]; then
    rlvr eval "${both[@]}" --k 1,4,8 --n 8 --temperature 1 --out "$out/$run.passk.json" seed="$seed" "${target[@]}"
  fi
  rlvr eval "${both[@]}" --k 1 --n 1 --temperature 0 --out "$out/$run.eval.json" seed="$seed" "${target[@]}"
} > "$out/$run.log" 2>&1
