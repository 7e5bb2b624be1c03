"""How often the bundled model answers one-digit chain_sum under prompt variants (the demo's choice).

    python bench/probe_prompts.py --temperature 1.0

For each instruction × system prompt: the fraction of 16 prompts × 4 samples with an <answer>
tag, correct under strict (tag) extraction, correct under lenient (tag or last number).
"""

from __future__ import annotations

import argparse
import statistics

from rlvr.data import reasoning_gym_examples, render_prompt
from rlvr.models import eos_token_ids, load_model, load_tokenizer
from rlvr.rewards import format_reward, reasoning_gym_reward
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams

INSTRUCTIONS = [
    "Give only the final answer inside <answer></answer> tags, e.g. <answer>42</answer>.",
    "Reply with the answer in this format: <answer>number</answer>",
    "Answer with just the number.",
    "Write only the number, inside <answer></answer> tags.",
]
SYSTEM_PROMPTS = [None, "You are a calculator. Example:\nuser: 2 + 5 =\nassistant: <answer>7</answer>"]
PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    model = load_model("builtin:smollm2-135m-instruct")
    engine = EmbeddedEngine(model, tok, eos_token_ids=eos_token_ids(model, tok))
    examples = reasoning_gym_examples("chain_sum", size=16, seed=0, params=PARAMS)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=64, n=4)
    for instruction in INSTRUCTIONS:
        for system in SYSTEM_PROMPTS:
            ids = [render_prompt(tok, ex.prompt + "\n\n" + instruction, system) for ex in examples]
            tags, strict, lenient, lengths = [], [], [], []
            for ex, group in zip(examples, engine.generate(ids, params)):
                for c in group:
                    kw = {"task": "chain_sum", "entry": ex.fields["entry"], "params": PARAMS}
                    tags.append(format_reward("", c.text))
                    strict.append(reasoning_gym_reward("", c.text, extract="tag", **kw))
                    lenient.append(reasoning_gym_reward("", c.text, extract="tag_or_last_number", **kw))
                    lengths.append(len(c.token_ids))
            print(f"{instruction[:40]!r:44s} system={'example' if system else 'default'}: "
                  f"tag {statistics.fmean(tags):.2f}  strict {statistics.fmean(strict):.2f}  "
                  f"lenient {statistics.fmean(lenient):.2f}  length {statistics.fmean(lengths):.0f}")


if __name__ == "__main__":
    main()
