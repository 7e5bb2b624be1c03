"""Supervised and preference training on the machinery of `rlvr train`: SFT (`rlvr sft`) and
DPO/IPO, offline on a file of pairs or online on the policy's own samples (`rlvr dpo`).

The same run directory (config.toml, metrics.jsonl, checkpoints that resume exactly, Ctrl-C
saving one), the same model loading (LoRA included), and the same greedy held-out evaluation
on the task before and after. So a pipeline such as SFT → GRPO is a chain of runs, each
starting from the one before (`model = "runs/<name>"`) and each measured the same way.

- **SFT.** Conversations are tokenized with an assistant-only loss mask (rlvr.data.chat). With
  `sft.pack`, several go into each row of `sft.max_length` tokens. Each keeps its own positions
  and a block-diagonal causal mask keeps it to itself, so a packed row computes exactly what the
  separate rows would (tested). The loss is the token mean of −log p over every trained token of
  the optimizer batch (`rlvr.algos.supervised.sft_token_loss`).
- **DPO/IPO.** Each pair's chosen and rejected answers are scored by their summed log-probs
  under the policy and under the reference, the initial model (`cfg.model`). The reference
  log-probs of a file are computed once, before training. The loss is
  `rlvr.algos.supervised.dpo_loss`, averaged over the pairs of a step.
- **Online DPO** (`dpo.online`). Each step samples `algo.group_size` answers to
  `train.prompts_per_step` task prompts with the current policy, exactly as `rlvr train` does
  (same sampler, rewards and rollout strategy). It pairs each group's best answer with its worst,
  as token ids, never re-encoded. A group whose rewards are all equal gives no pair.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlvr.algos.supervised import dpo_loss, sft_token_loss
from rlvr.config import DPOConfig, DPORunConfig, RunConfig, SFTRunConfig, load_config
from rlvr.data.chat import (PreferencePair, Tokenized, messages_of, pack, preference_pair, read_rows, tokenize_chat,
                             truncate, with_system)
from rlvr.data.tasks import demonstration_text
from rlvr.log.sinks import ConsoleProgress, JsonlSink, read_jsonl
from rlvr.models import load_model, load_tokenizer, resolve_device, resolve_dtype
from rlvr.train import checkpoint as ckpt
from rlvr.train.data import load_examples
from rlvr.train.logprobs import packed_batch, packed_logprobs, token_budget_batches
from rlvr.train.run import collect
from rlvr.train.evaluate import evaluate_held_out
from rlvr.train.records import is_number, sample_rows, summary_line, with_held_out_gain
from rlvr.train.run import Run
from rlvr.train.setup import NO_CONFIG, open_run, save
from rlvr.train.stop import GracefulStop, resumable, stop_if_requested
from rlvr.train.rollouts import group_metrics
from rlvr.types import Group

SFT_LIVE = {"loss": ("loss", "{:.3f}"), "trained_tokens": ("trained", "{:.0f}"), "step_seconds": ("s/step", "{:.1f}")}
DPO_LIVE = {"loss": ("loss", "{:.3f}"), "preference_accuracy": ("pref-acc", "{:.2f}"), "margin": ("margin", "{:.2f}"),
            "reward": ("reward", "{:.3f}"), "step_seconds": ("s/step", "{:.1f}")}


# ---------------------------------------------------------------- batches

def _micro_batches(rows: list[list[Tokenized]], max_tokens: int) -> Iterator[list[list[Tokenized]]]:
    """Consecutive rows whose padded size (rows × longest row) stays within max_tokens (one row at least)."""
    for cut in token_budget_batches([sum(len(t.ids) for t in row) for row in rows], max_tokens):
        yield [rows[i] for i in cut]


def _max_tokens(cfg: RunConfig) -> int:
    """Padded tokens per micro-batch (train.micro_batch_tokens; unset = no cap)."""
    return cfg.train.micro_batch_tokens or 1 << 62


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def _step_items(n: int, batch_size: int, seed: int, step: int) -> tuple[list[int], int]:
    """The item indices of a (1-based) step and its epoch: each epoch a fresh shuffle, cut into batches."""
    per_epoch = math.ceil(n / batch_size)
    epoch, k = divmod(step - 1, per_epoch)
    return _epoch_order(n, seed, epoch)[k * batch_size : (k + 1) * batch_size], epoch


# ---------------------------------------------------------------- data

@dataclass
class SFTData:
    rows: list[list[Tokenized]]
    """Training rows: packed groups of conversations, or one conversation each."""
    stats: dict[str, int]


def sft_data(cfg: SFTRunConfig, tokenizer: Any) -> SFTData:
    s = cfg.sft
    eos = _eos_ids(tokenizer)
    convs: list[Tokenized] = []
    truncated = dropped = 0
    for where, messages in _conversations(cfg):
        t = tokenize_chat(tokenizer, with_system(messages, cfg.task.system_prompt), eos_token_ids=eos)
        if len(t.ids) > s.max_length:
            t, truncated = truncate(t, s.max_length), truncated + 1
        if t.trained == 0:  # nothing of an assistant turn survived (or there was none)
            dropped += 1
            continue
        convs.append(t)
    if not convs:
        raise ValueError(f"{s.data or 'sft.task_examples'}: no conversation has an assistant token within "
                         f"sft.max_length = {s.max_length}")
    rows = [[convs[i] for i in r] for r in pack([len(t.ids) for t in convs], s.max_length)] if s.pack \
        else [[t] for t in convs]
    return SFTData(rows, {"conversations": len(convs), "truncated": truncated, "dropped": dropped, "rows": len(rows),
                          "trained_tokens": sum(t.trained for t in convs)})


def _eos_ids(tokenizer: Any) -> set[int]:
    """The end-of-turn token that closes a trained answer (the tokenizer's EOS)."""
    return {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()


def _conversations(cfg: SFTRunConfig) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(where, messages) of sft.data's rows, or of the task's first sft.task_examples training prompts."""
    s = cfg.sft
    if s.data and s.task_examples:
        raise ValueError("set one of sft.data and sft.task_examples, not both")
    if s.data:
        for number, row in read_rows(s.data):
            where = f"{s.data}:{number}"
            yield where, messages_of(row, where)
        return
    if not s.task_examples:
        raise ValueError("rlvr sft needs data: set sft.data to a JSONL file of conversations, or sft.task_examples "
                         "to answer the task's own training prompts")
    examples = load_examples(cfg)[0][: s.task_examples]
    for ex in examples:
        if ex.answer is None:
            raise ValueError(f"sft.task_examples: example {ex.id} has no reference answer to train on")
        answer = demonstration_text(ex, s.answer_template)
        yield ex.id, [{"role": "user", "content": ex.prompt}, {"role": "assistant", "content": answer}]


def preference_data(cfg: DPORunConfig, tokenizer: Any) -> tuple[list[PreferencePair], dict[str, int]]:
    d = cfg.dpo
    if not d.data:
        raise ValueError("rlvr dpo needs preference pairs: set dpo.data to a JSONL file, or dpo.online = true")
    eos = _eos_ids(tokenizer)
    pairs, truncated, outside, dropped = [], 0, 0, 0
    for number, row in read_rows(d.data):
        where = f"{d.data}:{number}"
        pair = preference_pair(tokenizer, row, where, eos_token_ids=eos, system_prompt=cfg.task.system_prompt)
        if d.min_gap is not None or d.max_gap is not None:
            if pair.gap is None:
                raise ValueError(f"{where}: dpo.min_gap/max_gap select pairs by their score gap, and this row has "
                                 "no \"score_chosen\" and \"score_rejected\"")
            if (d.min_gap is not None and pair.gap < d.min_gap) or (d.max_gap is not None and pair.gap >= d.max_gap):
                outside += 1
                continue
        if max(len(pair.chosen.ids), len(pair.rejected.ids)) > d.max_length:
            truncated += 1
            pair = PreferencePair(truncate(pair.chosen, d.max_length), truncate(pair.rejected, d.max_length), pair.gap)
            if not (pair.chosen.trained and pair.rejected.trained):  # the prompt filled dpo.max_length
                dropped += 1  # kept, it scored log 2 and a wrong preference whatever the policy did
                continue
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{d.data}: no pair left ({outside} outside dpo.min_gap/max_gap, {dropped} with no answer "
                         f"token within dpo.max_length = {d.max_length})")
    return pairs, {"pairs": len(pairs), "truncated": truncated, "dropped": dropped, "outside_gap": outside}


def _dpo_headline(st: dict[str, int], cfg: DPORunConfig) -> str | None:
    """What `rlvr dpo` says before its first step where pairs were cut or dropped."""
    if not (st["truncated"] or st["dropped"]):
        return None
    return (f"note: {st['truncated']} pairs cut at dpo.max_length = {cfg.dpo.max_length}, {st['dropped']} of them "
            "dropped (no answer token left)")


# ---------------------------------------------------------------- steps

def sft_step(run: Run, rows: list[list[Tokenized]], weighting: str = "none") -> dict[str, float]:
    """One optimizer step on `rows`: the token mean of the (weighted) NLL over all their trained tokens."""
    cfg, learner = run.cfg, run.learner
    device = next(learner.model.parameters()).device
    total = sum(t.trained for row in rows for t in row)
    seen = sum(len(t.ids) for row in rows for t in row)
    nll = 0.0
    for micro in _micro_batches(rows, _max_tokens(cfg)):
        batch = packed_batch(micro, run.engine.pad_token_id, device)
        logprobs_BT = packed_logprobs(learner.model, batch, cfg.train.logprob_chunk)
        loss = sft_token_loss(logprobs_BT, batch["target"], weighting=weighting).sum() / total
        loss.backward()
        nll += float(-(logprobs_BT.detach() * batch["target"]).sum())
    grad_norm = learner.step()
    return {"loss": nll / total, "trained_tokens": float(total), "tokens": float(seen), "grad_norm": grad_norm}


def sequence_logprobs(model: Any, pairs: list[tuple[Tokenized, Tokenized]], pad_token_id: int, chunk: int,
                      max_tokens: int) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """For micro-batches of pairs: (first pair, end, chosen_B, rejected_B), the summed log-probs of
    each answer's trained tokens (with gradients when the model has them)."""
    device = next(model.parameters()).device
    # a pair is two rows padded to its longer answer: 2 × that many tokens of the budget
    for cut in token_budget_batches([2 * max(len(c.ids), len(r.ids)) for c, r in pairs], max_tokens):
        start, end = cut[0], cut[-1] + 1
        rows = [[t] for c, r in pairs[start:end] for t in (c, r)]
        batch = packed_batch(rows, pad_token_id, device)
        seq_B = (packed_logprobs(model, batch, chunk) * batch["target"]).sum(-1)
        yield start, end, seq_B[0::2], seq_B[1::2]


@torch.no_grad()
def reference_logprobs(model: Any, pairs: list[tuple[Tokenized, Tokenized]], pad_token_id: int, chunk: int,
                       max_tokens: int, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """[P, 2]: the reference model's summed log-probs of each pair's chosen and rejected answer."""
    out = torch.zeros(len(pairs), 2)
    for start, end, chosen_B, rejected_B in sequence_logprobs(model, pairs, pad_token_id, chunk, max_tokens):
        out[start:end, 0], out[start:end, 1] = chosen_B.float().cpu(), rejected_B.float().cpu()
        if progress:
            progress(end - start)
    return out


def dpo_step(run: Run, pairs: list[tuple[Tokenized, Tokenized]], ref_P2: torch.Tensor,
             d: DPOConfig) -> dict[str, float]:
    """One optimizer step of the preference loss `d` sets, averaged over `pairs`."""
    cfg, learner = run.cfg, run.learner
    sums: dict[str, float] = {}
    for start, end, chosen_B, rejected_B in sequence_logprobs(learner.model, pairs, run.engine.pad_token_id,
                                                               cfg.train.logprob_chunk, _max_tokens(cfg)):
        ref = ref_P2[start:end].to(chosen_B.device)
        loss_B, metrics = dpo_loss(chosen_B, rejected_B, ref[:, 0], ref[:, 1], beta=d.beta, kind=d.loss,
                                   label_smoothing=d.label_smoothing)
        (loss_B.sum() / len(pairs)).backward()
        for key, value in {"loss": loss_B.detach().mean(), **metrics}.items():
            sums[key] = sums.get(key, 0.0) + float(value) * (end - start)
    grad_norm = learner.step()
    return {key: value / len(pairs) for key, value in sums.items()} | {"pairs": float(len(pairs)), "grad_norm": grad_norm}


def best_and_worst(groups: list[Group]) -> list[tuple[Tokenized, Tokenized]]:
    """Online DPO's pairs: per group, the highest-reward sample over the lowest (first of ties),
    as the exact sampled token ids; groups whose rewards are all equal give none."""
    pairs = []
    for g in groups:
        kept = [s for s in g.samples if not s.excluded]
        if len(kept) < 2:
            continue
        best = max(kept, key=lambda s: s.reward)
        worst = min(kept, key=lambda s: s.reward)
        if best.reward == worst.reward:
            continue
        pairs.append(tuple(Tokenized(s.prompt_ids + s.completion.token_ids,
                                     (0,) * len(s.prompt_ids) + (s.completion.loss_mask or (1,) * len(s.completion.token_ids)))
                           for s in (best, worst)))
    return pairs  # type: ignore[return-value]


# ---------------------------------------------------------------- runs

def _config(cfg: RunConfig | None, resume: str | Path | None, overrides: tuple[str, ...], command: str) -> Any:
    """`command`'s config: the one given, or the resumed run's own."""
    if resume is not None:
        return load_config(Path(resume) / "config.toml", overrides, command=command)
    if cfg is None:
        raise ValueError(NO_CONFIG.format(command=command))
    if cfg.command != command:
        raise ValueError(f"{command}() needs `rlvr {command}`'s config: load_config(..., command=\"{command}\")")
    return cfg


def sft(cfg: SFTRunConfig | None = None, *, resume: str | Path | None = None, overrides: tuple[str, ...] = (),
        quiet: bool = False) -> dict[str, Any]:
    """Supervised fine-tuning on `sft.data` (see module docstring); returns the summary also
    written to summary.json."""
    cfg = _config(cfg, resume, overrides, "sft")
    data = sft_data(cfg, load_tokenizer(cfg.model))
    s = cfg.sft
    total = math.ceil(len(data.rows) / s.batch_size) * s.epochs
    run, start = open_run(cfg, resume=resume, overrides=overrides, quiet=quiet, command="sft", optimizer_steps=total)

    def step(k: int) -> tuple[dict[str, Any], list[Group]]:
        items, epoch = _step_items(len(data.rows), s.batch_size, cfg.seed, k)
        return sft_step(run, [data.rows[i] for i in items], s.weighting) | {"epoch": float(epoch)}, []

    return _fit(run, start, total, step, quiet=quiet, command="sft", live=SFT_LIVE, evaluate_too=s.eval,
                data=data.stats, headline=_sft_headline(data.stats, cfg, total // s.epochs))


def _sft_headline(st: dict[str, int], cfg: SFTRunConfig, per_epoch: int) -> str:
    """What `rlvr sft` says before its first step: the data, the steps it makes, and what to check."""
    s = cfg.sft
    steps = f"{per_epoch} step{'s' if per_epoch > 1 else ''}"
    packed = f" packed to at most {s.max_length} tokens" if s.pack else ""
    lines = [f"{st['conversations']} conversations ({st['trained_tokens']} trained tokens) in {st['rows']} rows{packed}: "
             f"{steps} per epoch of {s.batch_size} rows, {s.epochs} epoch{'s' if s.epochs > 1 else ''}"]
    if per_epoch < 4:  # a small set packs into a few long rows
        lines.append(f"note: only {steps.replace('step', 'optimizer step')} per epoch; lower sft.batch_size or "
                     "sft.max_length for more, smaller steps")
    if st["truncated"] or st["dropped"]:
        lines.append(f"note: {st['truncated']} conversations cut at sft.max_length = {s.max_length}, "
                     f"{st['dropped']} dropped (no assistant token left)")
    return "\n".join(lines)


def dpo(cfg: DPORunConfig | None = None, *, resume: str | Path | None = None, overrides: tuple[str, ...] = (),
        quiet: bool = False) -> dict[str, Any]:
    """DPO or IPO on `dpo.data`, or online on the policy's own samples (`dpo.online`); returns the
    summary also written to summary.json."""
    cfg = _config(cfg, resume, overrides, "dpo")
    d = cfg.dpo
    if d.online:
        if d.data:
            raise ValueError("dpo.online pairs the policy's own samples; unset dpo.data (or dpo.online)")
        if cfg.env.name is not None and cfg.env.summarize:
            raise ValueError("online DPO does not train summarised episodes (env.summarize)")
        run, start = open_run(cfg, resume=resume, overrides=overrides, quiet=quiet, command="dpo")
        ref = _reference(run)

        def online_step(k: int) -> tuple[dict[str, Any], list[Group]]:
            collected = collect(run, k)
            groups = collected.gathered.train
            pairs = best_and_worst(groups)
            out = group_metrics(groups, run.task.rewards[0].name) | {"pairs": float(len(pairs))}
            if pairs:
                c = run.cfg.train
                ref_P2 = reference_logprobs(ref, pairs, run.engine.pad_token_id, c.logprob_chunk, _max_tokens(cfg))
                out |= dpo_step(run, pairs, ref_P2, d)
            else:
                out["skipped_update"] = 1.0
            run.rollouts.observe(groups, collected.gathered.aside, k)
            return out, groups

        return _fit(run, start, cfg.train.steps, online_step, quiet=quiet, command="dpo", live=DPO_LIVE,
                    evaluate_too=True, data={})
    tokenizer = load_tokenizer(cfg.model)
    pairs, stats = preference_data(cfg, tokenizer)
    total = math.ceil(len(pairs) / d.batch_size) * d.epochs
    run, start = open_run(cfg, resume=resume, overrides=overrides, quiet=quiet, command="dpo", optimizer_steps=total)
    as_tuples = [(p.chosen, p.rejected) for p in pairs]
    ref_P2 = torch.zeros(len(pairs), 2)

    def score_reference(progress: ConsoleProgress) -> None:
        """The reference's log-probs of every pair, once; then the reference is freed."""
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            progress.status(f"reference log-probs {done}/{len(pairs)} pairs")

        advance(0)
        ref_P2[:] = reference_logprobs(_reference(run), as_tuples, run.engine.pad_token_id, cfg.train.logprob_chunk,
                                       _max_tokens(cfg), advance)

    def offline_step(k: int) -> tuple[dict[str, Any], list[Group]]:
        items, epoch = _step_items(len(pairs), d.batch_size, cfg.seed, k)
        return dpo_step(run, [as_tuples[i] for i in items], ref_P2[items], d) | {"epoch": float(epoch)}, []

    return _fit(run, start, total, offline_step, quiet=quiet, command="dpo", live=DPO_LIVE, evaluate_too=True,
                data=stats, prepare=score_reference, headline=_dpo_headline(stats, cfg))


def _reference(run: Run) -> Any:
    """The reference policy: the run's initial model (`model`), frozen."""
    cfg = run.cfg
    device = resolve_device(cfg.train.device)
    return load_model(cfg.model, resolve_dtype(cfg.train.precision, device), device).eval().requires_grad_(False)


def _fit(run: Run, start: int, total: int, step_fn: Callable[[int], tuple[dict[str, Any], list[Group]]], *,
         quiet: bool, command: str, live: dict[str, tuple[str, str]], evaluate_too: bool,
         data: dict[str, int], prepare: Callable[[ConsoleProgress], None] | None = None,
         headline: str | None = None) -> dict[str, Any]:
    """The step loop shared by SFT and DPO: held-out evaluation before and after, metrics and
    samples to the run directory, checkpoints (at step 0, every checkpoint_every steps, at the
    end, on Ctrl-C), and the summary. `prepare` runs once before the first step, inside the
    progress display."""
    cfg = run.cfg
    summary_path = run.dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    summary |= {"command": command, "data": data} if data else {"command": command}
    progress = ConsoleProgress(total, start, live=live, label=command)
    if quiet:
        progress.console.quiet = True
    metrics_sink, samples_sink = JsonlSink(run.dir / "metrics.jsonl"), JsonlSink(run.dir / "samples.jsonl")
    try:
        with resumable(run, progress), progress, GracefulStop(progress) as stop:
            if headline:
                progress.print(headline)
            if start == 0 and ckpt.latest_checkpoint(run.dir) is None:
                save(run, 0)
            if evaluate_too and start == 0 and "eval_before" not in summary:
                progress.status("evaluating (before)")
                summary["eval_before"], summary["held_out_before"] = evaluate_held_out(run)
                ckpt.write_atomic(summary_path, json.dumps(summary, indent=2))
            if prepare is not None and start < total:  # e.g. DPO's reference log-probs, with a status line
                prepare(progress)
            for k in range(start + 1, total + 1):
                t0 = time.perf_counter()
                metrics, groups = step_fn(k)
                run.updater.sync(run.engine)  # the engine serves the new weights (evaluation, online sampling)
                seconds = time.perf_counter() - t0
                metrics = {"step": k, **metrics, "lr": run.learner.applied_lr, "step_seconds": seconds}
                if "tokens" in metrics:
                    metrics["tokens_per_second"] = metrics["tokens"] / seconds
                metrics_sink.write(metrics)
                if groups and k % cfg.samples_every == 0:
                    for row in sample_rows(k, groups):
                        samples_sink.write(row)
                progress.step(k, metrics)
                stop_if_requested(run, k, stop, progress)
                if cfg.checkpoint_every and k % cfg.checkpoint_every == 0 and k < total:
                    progress.status("checkpointing")
                    save(run, k)
            if start < total:
                save(run, total)
            stop.finishing = True
            if evaluate_too and "eval_after" not in summary:
                progress.status("evaluating (after)")
                summary["eval_after"], summary["held_out_after"] = evaluate_held_out(run, total)
    finally:
        metrics_sink.close()
        samples_sink.close()
    summary = with_held_out_gain(summary | _totals(run, total))
    ckpt.write_atomic(summary_path, json.dumps(summary, indent=2))
    progress.print(summary_line(summary))
    return summary


def _totals(run: Run, total: int) -> dict[str, Any]:
    """The run's totals from its metrics.jsonl: steps, seconds, and the loss at the start and the end
    (means over up to three steps)."""
    rows = read_jsonl(run.dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows if is_number(r.get("loss"))]  # any field may be missing from a row
    out = {"run_dir": str(run.dir), "steps": total,
           "seconds": sum(r["step_seconds"] for r in rows if is_number(r.get("step_seconds")))}
    if losses:
        k = max(1, min(3, len(losses) // 3))
        out |= {"loss_start": statistics.fmean(losses[:k]), "loss_end": statistics.fmean(losses[-k:])}
    return out
