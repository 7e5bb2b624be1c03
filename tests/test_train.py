"""End-to-end: a few GRPO steps on a tiny randomly initialised Llama, checkpoints, exact resume."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr.config import ConfigError, load_config
from rlvr.train.loop import Interrupted, RunDirError, train
from tests.tiny import make_tiny_model

TIMING = {"generate_seconds", "train_seconds", "step_seconds", "tokens_per_second", "elapsed_seconds", "memory_gb",
          "memory_released_gb", "cpu_threads", "cpu_busy_elsewhere"}
"""What the machine measures rather than the run computes (wall clock, memory, what other programs
used of the cores and the threads fitted to it): left out where two runs must agree."""


def distinct_chars(prompt: str, completion: str, **_: object) -> float:
    """A reward a random model gets different values of, so every group has signal."""
    return len(set(completion)) / 8.0


_calls = {"n": 0}


def interrupt_on_call_40(prompt: str, completion: str, **_: object) -> float:
    """Sends Ctrl-C to this process in the middle of step 3 (calls 33-48 with 4 × 4 samples)."""
    _calls["n"] += 1
    if _calls["n"] == 40:
        os.kill(os.getpid(), signal.SIGINT)
    return distinct_chars(prompt, completion)


def overrides(tiny_dir: Path, out: Path, name: str, reward: str = "distinct_chars", **extra: object) -> list[str]:
    base = {
        "model": f'"{tiny_dir}"', "output_dir": f'"{out}"', "name": name, "seed": 3,
        "task.size": 40, "task.eval_size": 4, "task.params": "{min_terms = 2, max_terms = 2, max_digits = 1}",
        "rewards": f'[{{fn = "tests.test_train:{reward}", name = "chars"}}]',
        "train.steps": 2, "train.prompts_per_step": 4, "train.micro_batch_size": 8, "train.lr": 1e-3,
        "algo.group_size": 4, "sampling.max_new_tokens": 8,
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


FP32 = ['train.precision="fp32"', 'engine.dtype="float32"']
"""For tests that compare two computations to fp32 rounding: "auto" may pick bf16 on this CPU
(or RLVR_AUTO_DTYPE=bf16, as CI's second pass sets), where each stored value is rounded to 8
significant bits, and the comparison would measure bf16 rounding instead of the property."""


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_change_parameters_and_write_the_run(tiny_dir: Path, tmp_path: Path) -> None:
    summary = train(load_config(None, overrides(tiny_dir, tmp_path, "e2e")), quiet=True)
    run = tmp_path / "e2e"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("reward", "reward_std", "accuracy", "response_length", "entropy", "clip_fraction",
                    "grad_norm", "lr", "zero_std_fraction", "truncated_fraction", "tokens_per_second"):
            assert math.isfinite(r[key]), key
        assert r["grad_norm"] > 0  # the reward varied, so there was a gradient
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
    assert {"prompt", "completion", "reward", "advantage", "finish_reason"} <= samples[0].keys()
    before = make_tiny_model().state_dict()
    after = load_file(run / "checkpoints" / "step_000002" / "model.safetensors")
    changed = [k for k, v in after.items() if not torch.equal(v.float(), before[k].float())]
    assert changed, "training did not change any parameter"
    assert (run / "config.toml").is_file() and summary["steps"] == 2
    assert "eval/accuracy" in summary["eval_before"] and "eval/accuracy" in summary["eval_after"]
    # each held-out prompt's greedy outcome, before and after, agrees with the accuracy, and the gain
    # is their paired difference (rlvr.eval.metrics.paired_difference, by hand here)
    for when in ("before", "after"):
        outcomes = summary[f"held_out_{when}"]  # by example id
        assert len(outcomes) == 4 and set(outcomes.values()) <= {0.0, 1.0}
        assert sum(outcomes.values()) / 4 == pytest.approx(summary[f"eval_{when}"]["eval/accuracy"])
    # the tiny model's reward is not pass/fail: accuracy 0 → 0 beside a mean reward, so no gain is
    # claimed; the gain's arithmetic on these outcomes, as if accuracy had moved, by hand
    from rlvr.train.records import held_out_gain

    assert summary["eval_before"]["eval/accuracy"] == summary["eval_after"]["eval/accuracy"] == 0
    assert "held_out_gain" not in summary
    diffs = [summary["held_out_after"][k] - b for k, b in summary["held_out_before"].items()]
    mean = sum(diffs) / 4
    gain = held_out_gain(summary | {"eval_before": {"eval/accuracy": 0.25}})
    assert gain is not None and gain["difference"] == pytest.approx(mean) and gain["prompts"] == 4
    assert gain["se"] == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3 / 4))
    json.dumps(json.loads((run / "summary.json").read_text()), allow_nan=False)  # strict JSON: no NaN
    # a plain transformers user can load the checkpoint
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000002")


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_compact"])  # compact: its rounding stream resumes too
def test_interrupted_and_resumed_run_matches_uninterrupted(tiny_dir: Path, tmp_path: Path, optimizer: str) -> None:
    extra = {"train__steps": 4, "train__optimizer": f'"{optimizer}"'}
    train(load_config(None, overrides(tiny_dir, tmp_path, "straight", **extra)), quiet=True)
    _calls["n"] = 0
    with pytest.raises(Interrupted):  # Ctrl-C during step 3: the loop finishes step 3, saves, stops
        train(load_config(None, overrides(tiny_dir, tmp_path, "stopped", reward="interrupt_on_call_40", **extra)),
              quiet=True)
    stopped = tmp_path / "stopped"
    assert [r["step"] for r in read_metrics(stopped)] == [1, 2, 3]
    _calls["n"] = 10_000  # no more interrupts
    train(resume=stopped, quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(stopped)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}


def test_resume_extends_a_finished_run(tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, overrides(tiny_dir, tmp_path, "short")), quiet=True)
    train(resume=tmp_path / "short", overrides=("train.steps=3",), quiet=True)
    assert [r["step"] for r in read_metrics(tmp_path / "short")] == [1, 2, 3]


def test_existing_run_dir_is_not_overwritten(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, overrides(tiny_dir, tmp_path, "twice"))
    train(cfg, quiet=True)
    marker = (tmp_path / "twice" / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="already exists"):
        train(cfg, quiet=True)
    assert (tmp_path / "twice" / "metrics.jsonl").read_text() == marker


def test_failed_setup_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = load_config(None, [f'output_dir="{tmp_path}"', "name=broken", f'model="{tmp_path / "no-such-model"}"'])
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        train(cfg, quiet=True)
    assert not (tmp_path / "broken").exists()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="not a run directory"):
        train(resume=tmp_path)


def test_kl_epochs_and_mini_batches_path(tiny_dir: Path, tmp_path: Path) -> None:
    """A reference model (KL), several epochs and mini-batches: old log-probs are recomputed."""
    cfg = load_config(None, overrides(tiny_dir, tmp_path, "kl", algo__kl_coef=0.1, train__epochs=2,
                                      train__mini_batches=2, train__micro_batch_size=3,
                                      algo__aggregation='"seq-mean-token-sum-norm"',
                                      algo__loss_kwargs="{dual_clip = 3.0}"))
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "kl")
    assert all(r["kl"] >= 0 and math.isfinite(r["kl"]) for r in rows)
    assert rows[-1]["kl"] > 1e-4  # after updates the policy has moved away from the reference
    assert any(r["ratio_mean"] != 1.0 for r in rows)  # later mini-batches see a moved policy
    assert all(r["ratio_max"] >= r["ratio_mean"] - 1e-6 for r in rows)  # the maximum is logged, not dropped
    assert any(r["ratio_max"] > 1.0 for r in rows)


def test_a_run_records_which_methods_it_composed_and_through_which_seams(tiny_dir: Path, tmp_path: Path) -> None:
    """Issue 52: methods switch on by the config alone, so each run says which did and where
    they plug in: in its first metrics row, in config.toml's header (which the report shows),
    and "none" for the core step alone."""
    from rlvr.train.methods import Method
    from rlvr.train.methods.registry import active

    train(load_config(None, overrides(tiny_dir, tmp_path, "kl", algo__kl_coef=0.1, train__steps=2)), quiet=True)
    rows = read_metrics(tmp_path / "kl")
    assert rows[0]["methods"] == "kl (prepare, after_update, state)" and "methods" not in rows[1]
    header = (tmp_path / "kl" / "config.toml").read_text().splitlines()
    assert "# methods: kl (prepare, after_update, state)" in header
    assert load_config(tmp_path / "kl" / "config.toml").algo.kl_coef == 0.1  # the header is a comment
    train(load_config(None, overrides(tiny_dir, tmp_path, "plain", train__steps=1)), quiet=True)
    assert read_metrics(tmp_path / "plain")[0]["methods"] == "none"

    class Scores(Method):  # a method whose rescore runs in training only beside an intrinsic reward
        state_key = "scores"

        def rescore(self, run, groups, examples, held_out):  # type: ignore[no-untyped-def]
            return groups

    assert active({"scores": Scores()}, intrinsic=True) == {"scores": ["rescore", "state"]}
    assert active({"scores": Scores()}, intrinsic=False) == {"scores": ["rescore (held-out only)", "state"]}


def test_jsonl_prompts_scored_with_math_verify(tiny_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n"
                            for i in range(12)))
    cfg = load_config(None, [f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "name=jsonl", "task.source=jsonl",
                             f'task.path="{data}"', "task.params.prompt_column=question", "task.params.answer_column=solution",
                             "task.eval_size=2", "train.steps=1", "train.prompts_per_step=2", "algo.group_size=2",
                             "sampling.max_new_tokens=4"])
    assert cfg.rewards[0].fn == "math_verify"
    train(cfg, quiet=True)
    samples = [json.loads(line) for line in (tmp_path / "jsonl" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all("math_verify" in s["rewards"] for s in samples)


def test_extended_run_follows_the_schedule_of_a_straight_run(tiny_dir: Path, tmp_path: Path) -> None:
    """Resume with more steps: a linear schedule is stretched to the new length, so the resumed
    run logs (and trains with) the same learning rates and metrics as a run that was 4 steps long
    from the start, except steps 1-2, which ran under the 2-step schedule."""
    linear = {"train__schedule": '"linear"'}
    train(load_config(None, overrides(tiny_dir, tmp_path, "straight4", train__steps=4, **linear)), quiet=True)
    straight = read_metrics(tmp_path / "straight4")
    assert [r["lr"] for r in straight] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])  # the lr each step used
    train(load_config(None, overrides(tiny_dir, tmp_path, "grown", **linear)), quiet=True)
    assert [r["lr"] for r in read_metrics(tmp_path / "grown")] == pytest.approx([1e-3, 5e-4])
    train(resume=tmp_path / "grown", overrides=("train.steps=4",), quiet=True)
    grown = read_metrics(tmp_path / "grown")
    # 2 of 4 optimizer steps done → factor 1 - 2/4 = 0.5, then 0.25
    assert [r["lr"] for r in grown[2:]] == pytest.approx([5e-4, 2.5e-4])


def test_resume_with_a_new_learning_rate_uses_it(tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, overrides(tiny_dir, tmp_path, "relr")), quiet=True)
    train(resume=tmp_path / "relr", overrides=("train.steps=3", "train.lr=5e-2"), quiet=True)
    assert read_metrics(tmp_path / "relr")[-1]["lr"] == pytest.approx(5e-2)
    assert load_config(tmp_path / "relr" / "config.toml").train.lr == pytest.approx(5e-2)


def test_resume_refuses_to_change_the_model(tiny_dir: Path, tmp_path: Path) -> None:
    train(load_config(None, overrides(tiny_dir, tmp_path, "keep")), quiet=True)
    before = (tmp_path / "keep" / "config.toml").read_text()
    with pytest.raises(RunDirError, match="cannot change on resume"):
        train(resume=tmp_path / "keep", overrides=("model=/elsewhere", "train.steps=3"), quiet=True)
    assert (tmp_path / "keep" / "config.toml").read_text() == before


def test_a_run_killed_before_its_first_step_can_be_resumed(tiny_dir: Path, tmp_path: Path) -> None:
    """The step-0 checkpoint is written before anything else runs; a run killed during step 1
    (simulated: its later checkpoints and logs removed) resumes from it and matches a straight run."""
    import shutil

    train(load_config(None, overrides(tiny_dir, tmp_path, "straight")), quiet=True)
    train(load_config(None, overrides(tiny_dir, tmp_path, "killed")), quiet=True)
    killed = tmp_path / "killed"
    for path in (killed / "checkpoints").glob("step_*"):
        if path.name != "step_000000":
            shutil.rmtree(path)
    (killed / "metrics.jsonl").write_text("")
    train(resume=killed, quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(killed)
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in b]


def test_a_time_budget_ends_the_run_early_with_a_checkpoint_and_the_final_evaluation(tiny_dir: Path,
                                                                                     tmp_path: Path) -> None:
    summary = train(load_config(None, [*overrides(tiny_dir, tmp_path, "budget"), "train.steps=5",
                                       "train.max_minutes=1e-6"]), quiet=True)
    run = tmp_path / "budget"
    assert [r["step"] for r in read_metrics(run)] == [1]
    assert summary["stopped_by_budget"]["step"] == 1 and "eval/accuracy" in summary["eval_after"]
    assert (run / "checkpoints" / "step_000001").is_dir()


def test_a_full_disk_stops_the_run_with_its_checkpoints_intact(tiny_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-2 save hits ENOSPC: the half-written folder is removed, step 1 stays, the error says
    how to resume, and the resumed run finishes."""
    import errno

    from rlvr.train import checkpoint
    from rlvr.train.checkpoint import CheckpointError

    real = checkpoint.save_merged

    def full_at_step_2(model: object, folder: Path) -> None:
        real(model, folder)
        if folder.name == ".step_000002.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_merged", full_at_step_2)
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "full"), "train.steps=3", "checkpoint_every=1"])
    with pytest.raises(CheckpointError) as caught:
        train(cfg, quiet=True)
    run = tmp_path / "full"
    message = str(caught.value)
    assert "step-2 checkpoint" in message and "No space left on device" in message
    assert "step_000001, is intact" in message and f"rlvr train --resume {run}" in message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000", "step_000001"]
    monkeypatch.setattr(checkpoint, "save_merged", real)
    train(resume=run, quiet=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003").is_dir()


def test_a_save_that_leaves_too_little_room_for_the_next_warns(tiny_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with caplog.at_level("WARNING", logger="rlvr.train"):
        train(load_config(None, overrides(tiny_dir, tmp_path, "tight")), quiet=True)
    warned = [r.getMessage() for r in caplog.records if "the next save will fail" in r.getMessage()]
    assert warned and "1.0 kB free" in warned[0]


def test_a_run_stopped_before_its_final_evaluation_resumes_to_finish_it(tiny_dir: Path, tmp_path: Path) -> None:
    """A Ctrl-C in the last step (or a kill after the last save) left no final evaluation and no
    summary totals, and a resume said "complete" (a review, session 19). A torn last row of
    metrics.jsonl and a torn summary.json, what a kill mid-write leaves, do not stop the resume."""
    import json

    train(load_config(None, overrides(tiny_dir, tmp_path, "cut")), quiet=True)
    run = tmp_path / "cut"
    full = json.loads((run / "summary.json").read_text())
    assert "eval_after" in full
    (run / "summary.json").write_text(json.dumps({"eval_before": full["eval_before"]}))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # cut off mid-row
    again = train(resume=run, quiet=True)
    assert "eval_after" in again and json.loads((run / "summary.json").read_text())["eval_after"] == full["eval_after"]
    (run / "summary.json").write_text('{"eval_before": {"acc')
    train(resume=run, overrides=("train.steps=3",), quiet=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_a_broken_row_inside_metrics_is_named_and_sigterm_stops_gracefully(tmp_path: Path) -> None:
    import os
    import signal

    from rlvr.log import ConsoleProgress
    from rlvr.train.checkpoint import truncate_jsonl
    from rlvr.train.stop import GracefulStop

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON row"):
        truncate_jsonl(path, 2)
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    truncate_jsonl(path, 5)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    before = signal.getsignal(signal.SIGTERM)  # whatever the test process had (a plugin may have set one)
    with GracefulStop(ConsoleProgress(3, 0)) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested  # stop after the step and save, as Ctrl-C does
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    """Found by a review (session 19): GRPO with one completion per prompt trained nothing and
    said nothing; a JSONL file that is not UTF-8 gave no file or line."""
    from rlvr.data.tasks import jsonl_examples

    with pytest.raises(ConfigError, match="group_size must be at least 2"):
        load_config(None, ["algo.group_size=1"])
    assert load_config(None, ["algo.group_size=1", 'algo.advantage="remax"']).algo.group_size == 1
    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: not UTF-8"):
        jsonl_examples(bad)
    bad.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\n')  # a byte-order mark is fine
    assert jsonl_examples(bad)[0].prompt == "a"


@pytest.mark.parametrize("broken", ["trainer_state.pt", "model.safetensors"])
def test_a_cut_off_latest_checkpoint_is_named_and_the_one_before_it_resumes(
        tiny_dir: Path, tmp_path: Path, broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint cut off after its rename (a power loss, a full disk) stopped a resume on a bare
    traceback (a review, session 19). A resume with changed settings says which, and keeps the
    config the earlier steps ran under."""
    train(load_config(None, overrides(tiny_dir, tmp_path, "cut", checkpoint_every=1, keep_checkpoints=3)), quiet=True)
    run = tmp_path / "cut"
    target = next((run / "checkpoints" / "step_000002").rglob(broken))
    target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])
    train(resume=run, overrides=("train.steps=3", "train.lr=0.002"), quiet=True)
    err = capsys.readouterr().err
    assert "step_000002 cannot be read" in err and "train.lr: 0.001 → 0.002" in err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert 'lr = 0.001' in (run / "config.before_step_2.toml").read_text()
    assert (run / "checkpoints" / "unreadable_step_000002").is_dir()  # moved aside, never resumed or counted


def test_a_run_killed_while_writing_its_first_checkpoint_starts_again(tiny_dir: Path, tmp_path: Path) -> None:
    """No checkpoint at all (killed during setup or the step-0 save): a resume said "delete this
    directory" (a review, session 19); it starts the run again from step 0 there, as a new run."""
    import shutil

    train(load_config(None, overrides(tiny_dir, tmp_path, "straight")), quiet=True)
    train(load_config(None, overrides(tiny_dir, tmp_path, "early")), quiet=True)
    early = tmp_path / "early"
    shutil.rmtree(early / "checkpoints")
    (early / "metrics.jsonl").write_text('{"step": 1, "lo')
    train(resume=early, quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(early)
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in b]


def test_prompts_that_do_not_fit_the_context_are_named_before_sampling(tiny_dir: Path, tmp_path: Path) -> None:
    """The tiny model has 2048 positions: a prompt that leaves no room for sampling.max_new_tokens
    is an error naming it (with the largest budget that fits) before any step runs, where the
    engine would have sampled past the model's positions; an empty prompt is named too."""
    from rlvr.config import load_config
    from rlvr.data import Example
    from rlvr.train.data import TaskData, check_prompt_lengths
    from rlvr.train.loop import train
    from rlvr.types import SamplingParams

    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "What is 2 + 2?", "answer": "4"}] * 7 + [{"prompt": "word " * 420, "answer": "5"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    base = [x for x in overrides(tiny_dir, tmp_path, "long", task__size=8) if not x.startswith("task.params")]
    cfg = [*base, 'task.source="jsonl"', f'task.path="{data}"', "task.eval_size=0"]
    with pytest.raises(ValueError, match=r"1 training prompt\(s\) are longer than the model's context of 2048 "
                                         r"positions, e\.g\. .*data\.jsonl:8 \(\d+ tokens\)"):
        train(load_config(None, cfg), quiet=True)
    assert not (tmp_path / "long" / "metrics.jsonl").exists()
    data.write_text("\n".join(json.dumps(r) for r in rows[:7]))
    with pytest.raises(ValueError, match=r"7 training prompt\(s\) leave too little room for sampling.max_new_tokens = "
                                         r"2030 in the model's context of 2048 positions.*at most (\d+)") as caught:
        train(load_config(None, [*cfg, "sampling.max_new_tokens=2030", "name=budget"]), quiet=True)
    fits = int(str(caught.value).split("at most ")[1].split(",")[0])  # the budget the message offers runs
    train(load_config(None, [*cfg, f"sampling.max_new_tokens={fits}", "name=fits", "train.steps=1"]), quiet=True)
    # a prompt template (sampler.templates) that pushes the prompts past it, named by its index
    long_template = '["{prompt}", "' + "Think it through. " * 150 + '{prompt}"]'
    with pytest.raises(ValueError, match=r"7 training \(sampler.templates\[1\]\) prompt\(s\) are longer than"):
        train(load_config(None, [*cfg, f"sampler.templates={long_template}", "name=templated"]), quiet=True)
    # a rope scaling's factor stretches the context (YaRN on Qwen2.5; Llama 3.1's config says it already)
    from transformers import LlamaConfig, Qwen2Config

    from rlvr.models import context_length

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)) == 131072
    llama32 = llama3 | {"factor": 32.0}  # Llama 3.2 1B/3B: the config states the scaled length
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama32)) == 131072
    assert context_length(LlamaConfig(max_position_embeddings=2048)) == 2048
    ex = Example(prompt="", answer=None, fields={}, id="row-3")
    task = TaskData([ex], [[]], [], [], [], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="1 training prompt.*no tokens, e.g. row-3"):
        check_prompt_lengths(task, 256)
    check_prompt_lengths(dataclasses.replace(task, prompt_ids=[[1] * 252]), 256)  # exactly fits
    with pytest.raises(ValueError, match="at most 3"):
        check_prompt_lengths(dataclasses.replace(task, prompt_ids=[[1] * 253]), 256)
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        check_prompt_lengths(dataclasses.replace(task, prompt_ids=[[1] * 256]), 256)


def always_fails(prompt: str, completion: str, **_: object) -> float:
    raise ValueError("this reward is broken")


def test_a_failing_reward_stops_the_run_at_the_first_evaluation_or_is_counted_there(tiny_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """on_reward_error = "stop": the held-out evaluation before training scored the failures 0 and
    went on, so the run stopped only at step 1, after a warning that it was scoring them 0. With
    "zero", the evaluation's rows count the failures, as a training step's do."""
    from rlvr.rewards.combine import RewardError

    failing = ['rewards=[{fn = "tests.test_train:always_fails", name = "broken"}]']
    with pytest.raises(RewardError, match="on_reward_error = \"stop\""):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "stop"), *failing, 'on_reward_error="stop"']),
              quiet=True)
    assert not (tmp_path / "stop" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "stop")
    summary = train(load_config(None, [*overrides(tiny_dir, tmp_path, "zero", train__steps=1), *failing]), quiet=True)
    assert summary["eval_before"]["eval/rewards/broken/error"] == 1.0
    assert read_metrics(tmp_path / "zero")[0]["rewards/broken/error"] == 1.0
