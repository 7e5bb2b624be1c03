"""A vision-language model learns a synthetic visual task from scratch on a CPU: SFT here, then GRPO
with `rlvr train` raises its held-out accuracy further.

    python examples/vlm_from_scratch.py --out runs/tiny-vlm             # build, SFT, evaluate (~6 min)
    rlvr train --config configs/vlm_digits.toml model=runs/tiny-vlm/sft  # GRPO on top, held-out every 10 steps

No pretrained VLM can be installed here, so the model is a small Llava built in code (a SigLIP
vision tower and a Llama language model with a byte-level tokenizer, tests/tiny.py), randomly
initialised and trained on rlvr's synthetic visual tasks (rlvr.data.visual), whose answers are
checked against the images' own pixels. The SFT is a plain loop over rendered prompts with images
(rlvr.data.images) and the learner's log-probs with pixel inputs (rlvr.train.logprobs): what a
user's own supervised warm-up of a VLM would be. On a 2-core Zen 3, 600 steps (the default) leave
the model reading ~26% of held-out digits, and GRPO takes it to ~44% in 150 steps; 1,200 steps
leave it at ~82%, and GRPO still adds a few points (docs/LOG.md, 2026-11-25 session 5, has the
curves and the comparison with more SFT). Real models: docs/vlm.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny, when run from anywhere

from rlvr.data.images import batched_inputs, render_with_images  # noqa: E402
from rlvr.data.visual import REWARD_OF, visual_examples  # noqa: E402
from rlvr.rewards import REWARDS  # noqa: E402
from rlvr.train.logprobs import token_logprobs  # noqa: E402
from tests.tiny import make_tiny_vlm  # noqa: E402

INSTRUCTION = "Answer inside <answer></answer> tags."


def rendered(processor: object, task: str, size: int, seed: int, params: dict) -> list[tuple[list[int], dict, str]]:
    """(prompt ids, pixel inputs, answer) of `size` examples."""
    out = []
    for ex in visual_examples(task, size=size, seed=seed, params=params, instruction=INSTRUCTION):
        ids, media = render_with_images(processor, ex.prompt, ex.fields["images"])
        out.append((ids, media, str(ex.answer)))
    return out


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, processor: object, task: str, params: dict, seed: int, size: int) -> float:
    """Greedy accuracy on `size` examples (rlvr's engine and the task's reward)."""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import PromptMedia, SamplingParams

    tokenizer = processor.tokenizer  # type: ignore[attr-defined]
    examples = visual_examples(task, size=size, seed=seed, params=params, instruction=INSTRUCTION)
    prompts = [render_with_images(processor, ex.prompt, ex.fields["images"]) for ex in examples]
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id], max_batch_size=64)
    out = engine.generate([p for p, _ in prompts], SamplingParams(temperature=0.0, max_new_tokens=24),
                          media=[PromptMedia(tuple(ex.fields["images"]), m) for ex, (_, m) in zip(examples, prompts)])
    rewards = {family: REWARDS[name] for family, name in REWARD_OF.items()}
    return sum(rewards[ex.fields["task"]](ex.prompt, group[0].text, **ex.fields) >= 1
               for ex, group in zip(examples, out)) / size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tiny-vlm")
    p.add_argument("--task", default="digits")
    p.add_argument("--params", default='{"min_length": 1, "max_length": 1, "font_size": 80}',
                   help="the task's parameters, as JSON (rlvr.data.visual); the default is configs/vlm_digits.toml's")
    p.add_argument("--train-size", type=int, default=2000)
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    params = json.loads(args.params)
    model, processor = make_tiny_vlm(seed=args.seed, text_hidden=128, text_layers=4, vision_hidden=64,
                                     vision_layers=2)
    model.train()
    tokenizer = processor.tokenizer
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; rendering "
          f"{args.train_size} {args.task} examples", flush=True)
    # seed 1000 + seed: images none of the GRPO run's (seed 0..) training or held-out ones
    data = rendered(processor, args.task, args.train_size, 1000 + args.seed, params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    for step in range(1, args.sft_steps + 1):
        batch = rng.sample(data, args.batch)
        rows = [(ids, tokenizer(f"<answer>{answer}</answer>", add_special_tokens=False)["input_ids"]
                 + [tokenizer.eos_token_id]) for ids, _, answer in batch]
        width = max(len(a) + len(b) for a, b in rows)
        ids_BT = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
        target_BT = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, (prompt, answer) in enumerate(rows):
            ids_BT[b, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            mask_BT[b, : len(prompt) + len(answer)] = 1
            target_BT[b, len(prompt) : len(prompt) + len(answer)] = True
        from rlvr.types import PromptMedia

        media = batched_inputs([PromptMedia((), m) for _, m, _ in batch], dtype=torch.float32)
        logprobs_BT, _ = token_logprobs(model, ids_BT, mask_BT, target_BT, media=media)
        loss = -logprobs_BT[target_BT].mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.sft_steps:
            print(f"sft step {step}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f} s", flush=True)
    model.eval()
    out = Path(args.out) / "sft"
    model.save_pretrained(out)
    processor.save_pretrained(out)
    # the GRPO config's held-out prompts: task seed 0, the first eval_size examples of the pool
    accuracy = greedy_accuracy(model, processor, args.task, params, 0, args.eval_size)
    print(f"saved {out}; greedy accuracy on {args.eval_size} examples of seed 0: {accuracy:.3f}")


if __name__ == "__main__":
    main()
