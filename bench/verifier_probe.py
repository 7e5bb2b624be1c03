"""How well a judge ranks a policy's own samples: the bundled model (or --policy) samples n
completions of each of a config's held-out prompts, the config's first reward says which are
right, and a reward to probe (a generative verifier by default) scores them. Reported:

- pairwise accuracy: over pairs of one prompt's samples, one right and one wrong, the share the
  judge scores the right one higher (a tie counts half); what GRPO's advantages need;
- AUC over all samples, and the accuracy of its verdict at one half (a probability only).

    OMP_NUM_THREADS=1 python bench/verifier_probe.py --judge runs/judge --config demo [--prompts 64]
"""

from __future__ import annotations

import argparse
import json

from rlvr.config import load_config
from rlvr.data import render_prompt
from rlvr.models import eos_token_ids, load_model, load_tokenizer
from rlvr.rewards.combine import ToScore, build_rewards, score_groups
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.data import load_examples
from rlvr.types import SamplingParams


def pairwise(groups: list[list[tuple[float, bool]]]) -> tuple[float, int]:
    wins, pairs = 0.0, 0
    for group in groups:
        for s_right, right in group:
            for s_wrong, other in group:
                if right and not other:
                    pairs += 1
                    wins += 1.0 if s_right > s_wrong else 0.5 if s_right == s_wrong else 0.0
    return (wins / pairs if pairs else float("nan")), pairs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--judge", required=True)
    ap.add_argument("--config", default="demo")
    ap.add_argument("--policy", default="builtin:smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--reward", default='{"fn": "generative_verifier", "kwargs": {"extract": "tag_or_last_number"}}')
    args = ap.parse_args()
    cfg = load_config(args.config)
    _, held = load_examples(cfg)
    held = held[: args.prompts]
    tok, model = load_tokenizer(args.policy), load_model(args.policy)
    engine = EmbeddedEngine(model, tok, eos_token_ids=eos_token_ids(model, tok))
    samples = engine.generate([render_prompt(tok, e.prompt, None) for e in held],
                              SamplingParams(temperature=cfg.sampling.temperature,
                                             max_new_tokens=cfg.sampling.max_new_tokens, n=args.n))
    probe = json.loads(args.reward)
    probe["kwargs"] = {**probe.get("kwargs", {}), "model": args.judge}
    truth, judge = build_rewards([cfg.rewards[0].model_dump(exclude_none=True)]), build_rewards([probe])
    items = [ToScore(e.prompt, [c.text for c in group], e.fields) for e, group in zip(held, samples)]
    right = [[t >= 1.0 - 1e-6 for t, _ in g] for g in score_groups(truth, items)]
    scores = [[t for t, _ in g] for g in score_groups(judge, items)]
    acc, pairs = pairwise([list(zip(s, r)) for s, r in zip(scores, right)])
    flat = [(s, r) for ss, rr in zip(scores, right) for s, r in zip(ss, rr)]
    auc, _ = pairwise([flat])
    verdicts = sum((s >= 0.5) == r for s, r in flat) / len(flat)
    print(json.dumps({"judge": args.judge, "config": args.config, "prompts": len(held), "n": args.n,
                      "right": round(sum(r for _, r in flat) / len(flat), 3), "pairs": pairs,
                      "pairwise_accuracy": round(acc, 3), "auc": round(auc, 3), "verdict_accuracy": round(verdicts, 3),
                      "mean_score_right": round(sum(s for s, r in flat if r) / max(1, sum(r for _, r in flat)), 3),
                      "mean_score_wrong": round(sum(s for s, r in flat if not r) / max(1, sum(not r for _, r in flat)), 3)}))


if __name__ == "__main__":
    main()
