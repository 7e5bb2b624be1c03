"""The `grpo` part of `rlvr bench`: one GRPO step end to end, rlvr vs TRL's GRPOTrainer.

Identical settings on both sides: the bundled model, the same prompts (one-digit chain_sum with
the demo's instruction), G completions per prompt, the same maximum length, temperature 1, no
top-k/top-p, learning rate 1e-6, no KL term, one optimizer step per batch, and the same reward
(reasoning-gym's score of the tag-or-last-number answer). Each side runs in its best CPU
configuration: rlvr with "auto" precision (measured per CPU), TRL in fp32 without gradient
checkpointing (its `bf16=True` autocast was no faster on CPU; docs/LOG.md), both
with micro-batches of min(16, P·G) sequences accumulated into one optimizer step (a single
64-sequence batch made TRL run out of 24 GB). The first step of each warms up and is not counted.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import torch

from rlvr.bench import INSTRUCTION, MODEL, TASK
from rlvr.rewards import reasoning_gym_reward
from rlvr.config import load_config
from rlvr.train.loop import setup, train_step
from rlvr.data import reasoning_gym_examples
from rlvr.models import resolve_model_path


def _reward_fn() -> Any:
    def score(completion: str, entry: dict[str, Any]) -> float:
        return reasoning_gym_reward("", completion, task="chain_sum", entry=entry, params=TASK,
                                    extract="tag_or_last_number")
    return score


def rlvr_steps(prompts: int, group: int, max_new_tokens: int, steps: int, engine_dtype: str = "auto",
               model_spec: str = MODEL) -> dict[str, Any]:
    from pathlib import Path

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            f"output_dir={out}", f"model='{model_spec}'", "task.params={min_terms=2, max_terms=2, min_digits=1, max_digits=1}",
            f'task.instruction="{INSTRUCTION}"', "task.eval_size=0", "task.size=200",
            'rewards=[{fn="reasoning_gym", kwargs={extract="tag_or_last_number"}}]',
            f"algo.group_size={group}", f"train.prompts_per_step={prompts}", f"train.micro_batch_size={min(16, prompts * group)}",
            f"sampling.max_new_tokens={max_new_tokens}", "train.lr=1e-6", f"train.steps={steps}",
            f'engine.dtype="{engine_dtype}"',
        ])
        run = setup(cfg, Path(out))
        threads = torch.get_num_threads()  # as setup fitted them (rlvr.cores)
        times, tokens, generate, learn, flat = [], [], [], [], []
        for step in range(1, steps + 1):
            metrics, _ = train_step(run, step)
            times.append(metrics["step_seconds"])
            tokens.append(metrics["tokens_generated"])
            generate.append(metrics["generate_seconds"])
            learn.append(metrics["train_seconds"])
            flat.append(metrics["zero_std_fraction"])
    # rlvr trains no sample of a group whose rewards are all equal (its advantage is 0), TRL runs
    # them all: the fraction of such groups tells how much of a step's training was skipped
    return {"s_per_step": statistics.fmean(times[1:]), "completion_tokens_per_step": statistics.fmean(tokens[1:]),
            "generate_s_per_step": statistics.fmean(generate[1:]), "train_s_per_step": statistics.fmean(learn[1:]),
            "zero_std_fraction": statistics.fmean(flat[1:]), "steps": times, "threads": threads}


def trl_steps(prompts: int, group: int, max_new_tokens: int, steps: int, model_spec: str = MODEL) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    examples = reasoning_gym_examples("chain_sum", size=200, seed=0, params=TASK, instruction=INSTRUCTION)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": ex.prompt}], "idx": i}
                              for i, ex in enumerate(examples)])
    score = _reward_fn()

    def reward(prompts: list[Any], completions: list[Any], idx: list[int], **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, examples[i].fields["entry"]) for t, i in zip(texts, idx)]

    times: list[float] = []
    lengths: list[float] = []

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - self.start)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    micro = min(16, prompts * group)
    path = resolve_model_path(model_spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, use_vllm=False, num_generations=group,
            # rlvr's micro-batch (min(16, P·G)) with gradient accumulation to one optimizer step
            # per P·G completions; TRL generates the whole P·G batch at once either way
            per_device_train_batch_size=micro, gradient_accumulation_steps=prompts * group // micro,
            max_completion_length=max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, learning_rate=1e-6,
            beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
            gradient_checkpointing=False, dataloader_num_workers=0, seed=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward,  # type: ignore[arg-type]
                              args=config, train_dataset=data, processing_class=tokenizer, callbacks=[Timer()])
        trainer.train()
    per_step_tokens = [m * prompts * group for m in lengths] or [float("nan")]
    return {"s_per_step": statistics.fmean(times[1:]), "completion_tokens_per_step": statistics.fmean(per_step_tokens[1:] or per_step_tokens),
            "steps": times}


def part_grpo(side: str, prompts: int, group: int, max_new_tokens: int, steps: int,
              engine_dtype: str = "auto", model_spec: str = MODEL) -> dict[str, Any]:
    """One side of the comparison; each side runs in its own process (rlvr.bench.compare_grpo),
    so TRL's process has neither rlvr's malloc tuning nor rlvr's allocator state."""
    if side == "rlvr":
        return {"part": "grpo", "side": side, **rlvr_steps(prompts, group, max_new_tokens, steps, engine_dtype, model_spec)}
    try:
        import trl  # noqa: F401
    except ImportError:
        return {"part": "grpo", "error": "TRL is not installed: pip install 'rlvr[bench]'"}
    return {"part": "grpo", "side": side, **trl_steps(prompts, group, max_new_tokens, steps, model_spec)}
