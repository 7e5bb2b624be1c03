#!/usr/bin/env bash
# The SFT -> GRPO pipeline on the bundled model (docs/pipelines.md), with GRPO alone beside it.
# Each stage is a run directory; `rlvr eval` measures every stage on the same held-out prompts.
# About 25 minutes on a 2-core CPU.
set -euo pipefail
tag=${1:-pipe}
rlvr sft --config configs/sft.toml name=$tag-sft                                   # stage 1: SFT
# stage 2: GRPO from it, at a quarter of the demo's learning rate: the SFT model samples with
# little entropy, few groups differ, and at 2e-5 Adam's steps on that thin signal undid the SFT gain
rlvr train --config configs/demo.toml model=runs/$tag-sft name=$tag-sft-grpo train.lr=5e-6
rlvr train --config configs/demo.toml name=$tag-grpo                                # GRPO alone, for comparison
rlvr eval --config configs/demo.toml --model builtin:smollm2-135m-instruct --model runs/$tag-sft \
  --model runs/$tag-sft-grpo --model runs/$tag-grpo --k 1,4,8 --n 8 --prompts 64 --out runs/$tag-eval.json
