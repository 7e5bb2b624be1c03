"""The training loop, as plain functions: set up a run, then sample → score → update, step by step.

    for step in steps:
        groups  = rollouts.take(step)        the sampler picks prompts; the engine samples G completions
                                             per prompt; the rewards score them
        plan    = method.prepare(...)        methods composed beside the step adjust it (rlvr.train.methods)
        result  = updater.update(plan)       advantages (by name) → policy loss (by name) over epochs × mini-batches
        method.after_update(...)
        engine  ← new weights                nothing to copy when engine and learner share the model
        sampler observes the groups with the update's result; log metrics and samples; checkpoint every N steps

Departures from the GRPO paper (arXiv:2402.03300), all configurable: clip-higher by default
(clip_high = 0.28, DAPO), token-mean loss aggregation (DAPO), no KL term unless kl_coef > 0.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from rlvr import scaleout
from rlvr.cores import ThreadWatch
from rlvr.agents.runner import episode_metrics
from rlvr.config import RunConfig
from rlvr.log import ConsoleProgress, JsonlSink, tracking
from rlvr.log.sinks import read_jsonl, setting_up
from rlvr.runtime import HeapWatch
from rlvr.train import checkpoint as ckpt
from rlvr.train.collect import Collected
from rlvr.train.evaluate import evaluate, evaluate_held_out
from rlvr.train.methods.registry import composed
from rlvr.train.methods.base import Plan
from rlvr.train.records import (SignalWatch, Thumbnails, sample_rows, summarise, summary_line, with_held_out_gain,
                                write_report)
from rlvr.train.rollouts import group_metrics
from rlvr.train.run import Run, collect
from rlvr.train.setup import RunDirError, open_run, save, setup
from rlvr.train.stop import GracefulStop, Interrupted, resumable, stop_if_requested
from rlvr.types import Group, oldest_version

__all__ = ["Interrupted", "RunDirError", "setup", "train", "train_step"]

log = logging.getLogger(__name__)


def train_step(run: Run, step: int, progress: ConsoleProgress | None = None) -> tuple[dict[str, Any], list[Group]]:
    """One step: sample, score, update. Returns the step's metrics and the groups it trained on."""
    t0 = time.perf_counter()
    if progress:
        progress.status("generating")
    collected = run.rollouts.take(step, lambda k: collect(run, k))  # asynchronous: generated during earlier updates
    serving = run.engine.version  # rollout workers: the weights' version before this update
    if not collected.groups:  # e.g. dynamic sampling found no group with differing rewards: nothing to learn
        return _skipped_step(run, step, collected, t0), []
    plan = Plan(collected.groups, collected.gathered.train, run.settings)
    for method in run.methods.values():  # e.g. ReMax's greedy baseline, LUFFY's demonstrations
        plan = method.prepare(run, plan, step)
    t1 = time.perf_counter()
    if progress:
        progress.status("training")
    result = run.updater.update(plan.groups, plan.settings, plan.extras)
    update = dict(result.metrics)
    for method in run.methods.values():  # e.g. ReLIFT's SFT step, RLP's EMA
        update |= method.after_update(run, plan, update, step)
    run.updater.sync(run.engine)
    run.rollouts.observe(result.outcomes(plan.own), collected.gathered.aside, step)
    t2 = time.perf_counter()
    metrics = _step_metrics(run, step, collected, plan, update, serving) | {
        "generate_seconds": t1 - t0, "train_seconds": t2 - t1, "step_seconds": t2 - t0}
    metrics["tokens_per_second"] = metrics["tokens_generated"] / (t2 - t0)
    if run.updater.probe_gap is not None:  # an engine with its own weights, checked after the sync (rlvr.rollout.probe)
        metrics["engine/probe_gap"] = run.updater.probe_gap
    return metrics, result.outcomes(plan.groups)


def _step_metrics(run: Run, step: int, collected: Collected, plan: Plan, update: dict[str, float],
                  serving: int | None) -> dict[str, Any]:
    """The step's row: the rollouts' metrics (the policy's own groups and those set aside), the
    update's, the sampler's, the engine's and the methods'."""
    trained_own = plan.groups[: len(plan.own)]  # with LUFFY, the groups with their demonstrations
    aside = collected.gathered.aside
    metrics = {"step": step, **group_metrics(trained_own + aside or plan.groups, run.task.rewards[0].name), **update,
               **collected.gathered.metrics, **run.rollouts.metrics(collected.replayed), "lr": run.learner.applied_lr,
               "tokens_generated": float(collected.tokens)}  # everything sampled, down-sampled away or not
    metrics |= episode_metrics(trained_own + aside)
    metrics |= _engine_metrics(run, trained_own, collected, serving)
    for method in run.methods.values():
        metrics |= method.metrics(run)
    return metrics


def _engine_metrics(run: Run, own: list[Group], collected: Collected, serving: int | None) -> dict[str, float]:
    """Rollout workers: the weights' version, restarts, how stale the samples were."""
    metrics = run.engine.metrics() | collected.metrics
    if not metrics:
        return {}
    oldest = oldest_version([x for g in own for x in g.samples])
    if serving is not None and oldest is not None:
        metrics["dist/staleness_max"] = float(serving - oldest)
    if run.cfg.dist.partial_rollouts():  # samples that newer weights finished
        crossed = [bool(x.completion.swapped_at) for g in own for x in g.samples]
        metrics["dist/partial_fraction"] = statistics.fmean(crossed) if crossed else 0.0
    return metrics


def _skipped_step(run: Run, step: int, collected: Collected, t0: float) -> dict[str, Any]:
    """A step with no group to train on: its rollouts are observed and logged, the policy is unchanged."""
    aside = collected.gathered.aside
    run.rollouts.observe([], aside, step)
    seconds = time.perf_counter() - t0
    metrics = {"step": step, **group_metrics(aside, run.task.rewards[0].name), **collected.gathered.metrics,
               **run.rollouts.metrics([]), **collected.metrics, "lr": run.learner.applied_lr, "skipped_update": 1.0,
               "generate_seconds": seconds, "train_seconds": 0.0, "step_seconds": seconds}
    metrics["tokens_per_second"] = metrics["tokens_generated"] / seconds
    return metrics


def train(cfg: RunConfig | None = None, *, resume: str | Path | None = None, overrides: tuple[str, ...] = (),
          quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) a training job; returns the summary also written to summary.json."""
    began = time.perf_counter()  # elapsed_seconds counts model loading and setup too: the user waits for them
    if not quiet:
        setting_up(began)
    run, start = open_run(cfg, resume=resume, overrides=overrides, quiet=quiet)
    try:
        try:
            scaleout.attach(run)  # dist.rollout_workers / learners / async_rollouts: the same loop, parts on Ray
        except BaseException:
            if resume is None:  # a new run that never started: its name stays free for the corrected command
                shutil.rmtree(run.dir, ignore_errors=True)
            raise
        progress = ConsoleProgress(run.cfg.train.steps, start, began=began)
        if quiet:
            progress.console.quiet = True
        with resumable(run, progress):  # any error that stops it says where it resumes from
            return _train_loop(run, start, began, progress)
    finally:
        scaleout.detach(run)


def _train_loop(run: Run, start: int, began: float, progress: ConsoleProgress) -> dict[str, Any]:
    cfg = run.cfg
    summary_path = run.dir / "summary.json"
    summary = _read_summary(summary_path)
    if start >= cfg.train.steps:
        return _completed(run, start, summary, progress)
    trackers = _trackers(run, start, progress)
    metrics_sink, samples_sink = JsonlSink(run.dir / "metrics.jsonl"), JsonlSink(run.dir / "samples.jsonl")
    thumbnails = Thumbnails(run.dir)
    outcome: tracking.Outcome = "failed"  # the trackers' status for the run, unless it gets further
    try:
        with progress, GracefulStop(progress) as stop:
            if start == 0 and ckpt.latest_checkpoint(run.dir) is None:
                save(run, 0)  # a run that dies before its first checkpoint can still be resumed
            if start == 0 and "eval_before" not in summary:
                progress.status("evaluating (before)")
                summary["eval_before"], summary["held_out_before"] = evaluate_held_out(run)
                ckpt.write_atomic(summary_path, json.dumps(summary, indent=2))
                trackers.log(0, summary["eval_before"])
            budget = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
            earlier = read_jsonl(run.dir / "metrics.jsonl")
            spent = sum(r.get("step_seconds") or 0.0 for r in earlier)
            # wall clock of the run's invocations so far (a resumed run goes on from its last row)
            carried = next((r["elapsed_seconds"] for r in reversed(earlier) if "elapsed_seconds" in r), 0.0)
            last = cfg.train.steps
            heap, signal, threads = HeapWatch(), SignalWatch(expert_mode=cfg.expert.mode), ThreadWatch()
            for step in range(start + 1, cfg.train.steps + 1):
                metrics, groups = train_step(run, step, progress)
                metrics |= heap.after_step()
                fitted, refit = threads.after_step()  # other programs took or left cores: threads re-fitted
                metrics |= fitted
                spent += metrics["step_seconds"]
                if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                    progress.status("evaluating")
                    metrics |= evaluate(run, step)  # greedy on the held-out prompts, in this step's row
                metrics["elapsed_seconds"] = carried + time.perf_counter() - began
                if step == 1:  # the run's first row says what it composed beside the step
                    metrics["methods"] = composed(run)
                metrics_sink.write(metrics)
                trackers.log(step, metrics)
                if step % cfg.samples_every == 0:
                    for row in sample_rows(step, groups, thumbnails):
                        samples_sink.write(row)
                progress.step(step, metrics)
                for note in (refit, signal.observe(metrics)):  # said (the signal's once per cause), kept in summary.json
                    if note:
                        progress.print(note)
                        summary.setdefault("notes", []).append({"step": step, "note": note})
                stop_if_requested(run, step, stop, progress)
                if budget is not None and spent >= budget and step < cfg.train.steps:
                    last = step
                    summary["stopped_by_budget"] = {"step": step, "minutes": spent / 60}
                    progress.print(f"train.max_minutes = {cfg.train.max_minutes} reached after step {step}")
                    break
                due = bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0
                if (due or any(m.save_after(step) for m in run.methods.values())) and step < cfg.train.steps:
                    progress.status("checkpointing")
                    save(run, step)
            save(run, last)
            stop.finishing = True
            progress.status("evaluating (after)")
            summary["eval_after"], summary["held_out_after"] = evaluate_held_out(run, last)
            trackers.log(last, summary["eval_after"])
        outcome = "finished"
    except KeyboardInterrupt:  # Ctrl-C: a graceful stop with its checkpoint, or a second one
        outcome = "interrupted"
        raise
    finally:
        metrics_sink.close()
        samples_sink.close()
        trackers.close(outcome)
    return _finish(run, summary, progress)


def _trackers(run: Run, start: int, progress: ConsoleProgress) -> tracking.Trackers:
    """The experiment trackers log.sinks names (TensorBoard, W&B, MLflow), continuing from `start`."""
    log = run.cfg.log
    return tracking.open_trackers(log.sinks, run.dir, name=run.dir.name, config=run.cfg.model_dump(), start_step=start,
                                  kwargs=log.sink_kwargs, warn=progress.print)


def _read_summary(path: Path) -> dict[str, Any]:
    """summary.json as far as the run got, or {} (none yet, or one cut off in place by a kill
    before summaries were written atomically: what it held is in metrics.jsonl)."""
    try:
        summary: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        return summary
    except ValueError:
        log.warning("%s is not readable JSON; starting it afresh", path)
        return {}


def _completed(run: Run, start: int, summary: dict[str, Any], progress: ConsoleProgress) -> dict[str, Any]:
    """A run resumed at or past its last step: done, or, stopped after its last step but before
    its final evaluation and summary (a Ctrl-C in the last step, a kill after the last save),
    finished now, where it said "complete" and left them unwritten (a review, session 19)."""
    if "eval_after" in summary or start == 0:
        progress.print(f"{run.dir} is complete at step {start}; raise train.steps to continue it")
        return summary
    progress.print(f"{run.dir} trained all {start} steps; finishing it: the final evaluation and summary")
    with progress:
        progress.status("evaluating (after)")
        summary["eval_after"], summary["held_out_after"] = evaluate_held_out(run, start)
    return _finish(run, summary, progress)


def _finish(run: Run, summary: dict[str, Any], progress: ConsoleProgress) -> dict[str, Any]:
    """summary.json with the run's totals, the one-line result, and the report."""
    summary = with_held_out_gain(summary | summarise(run.dir / "metrics.jsonl", run.dir))
    ckpt.write_atomic(run.dir / "summary.json", json.dumps(summary, indent=2))
    progress.print(summary_line(summary))
    if run.cfg.log.report:
        write_report(run.dir, progress)
    return summary
