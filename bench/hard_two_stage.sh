#!/usr/bin/env bash
# Issue 53's shipped recipe, measured: stage 1 `rlvr sft --config configs/hard_sum_sft.toml` (SFT on
# the task's own reference answers), then stage 2 `rlvr train --config configs/hard_sum.toml` (GRPO
# from stage 1) for what is left of BUDGET minutes (default 30) after stage 1's wall time. Then
# `rlvr eval` of the bundled model against stage 1 and against stage 2, greedy on the same 64
# held-out prompts (OUT/RUN-sft.eval.md, OUT/RUN.eval.md: the paired difference with its 95%
# interval), stage 2 against stage 1 (OUT/RUN.vs-sft.md), and pass@1/4/8 at temperature 1
# (OUT/RUN.passk.md). RUN is LABEL-seedSEED; the logs are
# OUT/RUN.log. Overrides after SEED go to both stages and to the evaluation, e.g. another task:
#   bash bench/hard_two_stage.sh OUT LABEL SEED [overrides...]
#   bash bench/hard_two_stage.sh /tmp/h53 recipe 1
#   SFT_ARGS="sft.answer_template='\"{answer}\"'" bash bench/hard_two_stage.sh /tmp/h53 legs 0 task.name=leg_counting 'task.params={}'
# SFT_ARGS are stage 1's own overrides (a shell word list), e.g. an sft.answer_template for a task
# whose examples have no {expression}.
# Runs may share the machine, one thread each (OMP_NUM_THREADS=1 unless set); start them together.
set -euo pipefail
out=$1; label=$2; seed=$3; shift 3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run="$label-seed$seed"
mkdir -p "$out"
[ -f "$out/$run.eval.json" ] && exit 0
rm -rf "${out:?}/$run" "${out:?}/$run-sft"
{
  eval "sft_args=(${SFT_ARGS:-})"
  t0=$(date +%s)
  rlvr sft --config configs/hard_sum_sft.toml seed="$seed" output_dir="$out" name="$run-sft" task.eval_size=0 \
    "${sft_args[@]}" "$@"
  t1=$(date +%s)
  left=$(python3 -c "print(round(${BUDGET:-30} - ($t1 - $t0) / 60, 2))")
  echo "stage 1 took $(( (t1 - t0) / 60 )) min; stage 2 gets $left min"
  base=(--model builtin:smollm2-135m-instruct --config configs/hard_sum.toml --prompts 64 --seed 0)
  rlvr eval "${base[@]}" --model "$out/$run-sft" --k 1 --n 1 --temperature 0 --out "$out/$run-sft.eval.json" seed="$seed" "$@"
  if ! python3 -c "import sys; sys.exit(0 if $left >= 1 else 1)"; then
    echo "less than a minute left: no stage 2"; exit 0
  fi
  rlvr train --config configs/hard_sum.toml seed="$seed" output_dir="$out" name="$run" model="$out/$run-sft" \
    train.steps=100000 train.max_minutes="$left" task.eval_size=0 "$@"
  rlvr eval "${base[@]}" --model "$out/$run-sft" --model "$out/$run" --k 1 --n 1 --temperature 0 \
    --out "$out/$run.vs-sft.json" seed="$seed" "$@"  # what stage 2 added to stage 1
  rlvr eval "${base[@]}" --model "$out/$run" --k 1,4,8 --n 8 --temperature 1 --out "$out/$run.passk.json" seed="$seed" "$@"
  rlvr eval "${base[@]}" --model "$out/$run" --k 1 --n 1 --temperature 0 --out "$out/$run.eval.json" seed="$seed" "$@"
} > "$out/$run.log" 2>&1
