"""How the bundled model does on each domain task before training (rlvr.data.domains): the mean
reward of 16 prompts × 4 samples at temperature 1, and one sample to read.

    OMP_NUM_THREADS=1 python bench/probe_domains.py [sql verilog past_tense abstain]
"""

from __future__ import annotations

import statistics
import sys

from rlvr.data import render_prompt
from rlvr.data.domains import domain_examples
from rlvr.models import eos_token_ids, load_model, load_tokenizer
from rlvr.rewards.builtin import REWARDS
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams

REWARD = {"sql": ["sql"], "verilog": ["verilog"], "past_tense": ["chrf", "bleu"], "abstain": ["abstention"]}


def main(names: list[str]) -> None:
    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    model = load_model("builtin:smollm2-135m-instruct")
    engine = EmbeddedEngine(model, tok, eos_token_ids=eos_token_ids(model, tok))
    params = SamplingParams(temperature=1.0, max_new_tokens=160, n=4)
    for name in names:
        examples = domain_examples(name, size=16, seed=1)
        groups = engine.generate([render_prompt(tok, e.prompt, None) for e in examples], params)
        for fn in REWARD[name]:
            reward = REWARDS[fn]
            scores, infos = [], []
            for e, group in zip(examples, groups):
                texts = [g.text for g in group]
                values = reward(e.prompt, texts, **e.fields) if fn in ("sql", "verilog") else \
                    [reward(e.prompt, t, **e.fields) for t in texts]
                scores += [float(v) for v in values]
                infos += [getattr(v, "info", {}) for v in values]
            keys = sorted({k for i in infos for k in i})
            extra = ", ".join(f"{k} {statistics.mean(i.get(k, 0.0) for i in infos):.2f}" for k in keys)
            print(f"{name} / {fn}: mean {statistics.mean(scores):.3f}, nonzero {sum(s > 0 for s in scores)}/{len(scores)}"
                  + (f" ({extra})" if extra else ""))
        print("   e.g.:", repr(groups[0][0].text[:300]))


if __name__ == "__main__":
    main(sys.argv[1:] or list(REWARD))
