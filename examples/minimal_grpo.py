"""GRPO written out by hand from rlvr's public pieces: engine, rewards, advantages, learner.

    python examples/minimal_grpo.py                      # the bundled SmolLM2-135M, ~25 s a step on 2 cores
    python examples/minimal_grpo.py --model PATH --steps 2

`rlvr train` runs the same step with logging, checkpoints and evaluation around it.
"""

from __future__ import annotations

import argparse
import random

import rlvr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-5)
    args = p.parse_args()
    rlvr.keep_freed_memory()  # glibc malloc: reuse freed memory, don't page-fault it back (~1.4x learner speed)

    # The policy, sampled by the embedded engine and trained by the learner: one set of weights.
    tokenizer = rlvr.load_tokenizer(args.model)
    model = rlvr.load_model(args.model)
    engine = rlvr.EmbeddedEngine(model, tokenizer, eos_token_ids=rlvr.eos_token_ids(model, tokenizer))
    learner = rlvr.Learner(model, lr=args.lr)

    # A task with checkable answers, and its verifier as the reward.
    task = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    examples = rlvr.reasoning_gym_examples("chain_sum", size=200, seed=0, params=task,
                                           instruction="Answer with just the number.")
    prompt_ids = [rlvr.render_prompt(tokenizer, ex.prompt) for ex in examples]
    rewards = rlvr.build_rewards([{"fn": "reasoning_gym", "kwargs": {"extract": "tag_or_last_number"}}])

    sampling = rlvr.SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.group_size)
    settings = rlvr.UpdateSettings(
        advantage=rlvr.AdvantageSettings("grpo", {"normalize_std": True}),   # group-relative advantages
        loss=rlvr.LossSettings("ppo_clip", {"clip_low": 0.2, "clip_high": 0.28},  # clipped surrogate, clip-higher
                               aggregation="token-mean", max_tokens=args.max_new_tokens),
    )
    rng = random.Random(0)
    for step in range(1, args.steps + 1):
        batch = rng.sample(range(len(examples)), args.prompts_per_step)
        # 1. sample G completions per prompt and score each with the reward functions
        groups = rlvr.generate_groups(engine, examples, prompt_ids, batch, rewards, sampling)
        # 2. advantages from the group's rewards, then one clipped policy-gradient step
        update = rlvr.update_policy(learner, groups, settings, pad_token_id=engine.pad_token_id)
        stats = rlvr.group_metrics(groups, rewards[0].name)
        print(f"step {step}: reward {stats['reward']:.3f}  accuracy {stats['accuracy']:.2f}  "
              f"length {stats['response_length']:.1f}  grad norm {update.metrics['grad_norm']:.3f}")


if __name__ == "__main__":
    main()
