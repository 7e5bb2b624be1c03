"""rlvr.scaleout on a local Ray: two rollout workers and two data-parallel learners reproduce the local
loop on the same seed; a killed rollout worker is restarted without changing the samples; a wait
on the workers that cannot complete fails with an error instead of hanging."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="rlvr.scaleout needs Ray (pip install 'rlvr[ray]')")

from rlvr.config import load_config  # noqa: E402
from rlvr.train.loop import train  # noqa: E402
from tests.test_train import FP32, TIMING, overrides, read_metrics  # noqa: E402

DIST = ["dist.rollout_workers=2", "dist.learners=2", "dist.ray.timeout_s=120"]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> object:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def comparable(row: dict) -> dict:
    """A row's numbers to compare across runs (timing and the scale-out's own aside); the first
    row's "methods" (what the run composed, a string) is compared exactly."""
    return {k: v for k, v in row.items() if k not in TIMING and not k.startswith("dist/") and k != "methods"}


@pytest.mark.dtype_independent  # pinned to fp32
def test_two_workers_and_two_learners_give_the_local_losses(tiny_dir: Path, tmp_path: Path) -> None:
    """fp32 (FP32): the ranks sum the gradient in another order, which fp32 rounds at ~1e-7; in
    bf16 every stored gradient is rounded to 8 bits, and that the accumulation order costs no more
    than bf16 itself is test_learner's bf16 micro-batch test (the same sums, in one process)."""
    base = [*overrides(tiny_dir, tmp_path, "local", train__steps=3), "train.micro_batch_size=4", *FP32]
    train(load_config(None, base), quiet=True)
    spread = [*overrides(tiny_dir, tmp_path, "ray", train__steps=3), "train.micro_batch_size=4", *DIST, *FP32]
    train(load_config(None, spread), quiet=True)
    local, dist = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "ray")
    assert [r["step"] for r in dist] == [1, 2, 3]
    for a, b in zip(local, dist, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for key in a:  # the same samples; the gradient summed over two ranks, in another order
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert dist[-1]["grad_norm"] > 0 and dist[-1]["dist/policy_version"] == 3
    assert local[0]["methods"] == dist[0]["methods"] == "none"  # the same composition, said the same way
    assert all(r["dist/staleness_max"] == 0 for r in dist)  # synchronous: every sample from the current policy


def test_a_killed_rollout_worker_is_restarted_and_the_samples_do_not_change(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr import scaleout
    from rlvr.train.loop import setup, train_step

    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "kill"), "dist.rollout_workers=1", "dist.ray.timeout_s=120"])
    (tmp_path / "kill").mkdir()
    runs = []
    for spread in (False, True):  # the local loop, then one rollout worker killed between steps
        run = setup(cfg, tmp_path / "kill")
        if spread:
            scaleout.attach(run)
        try:
            train_step(run, 1)
            if spread:
                ray.kill(run.engine.workers[0])  # dead: its next requests fail and are re-run on a new worker
            metrics, groups = train_step(run, 2)
        finally:
            scaleout.detach(run)
        runs.append((metrics, [[x.completion.token_ids for x in g.samples] for g in groups]))
    (local, local_samples), (killed, killed_samples) = runs
    assert killed["dist/worker_restarts"] == 1
    assert killed_samples == local_samples  # the restarted worker re-ran the prompts with the same seeds
    assert killed["loss"] == pytest.approx(local["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.one_precision
def test_a_weight_broadcast_that_cannot_complete_fails_within_the_timeout(tiny_dir: Path, tmp_path: Path) -> None:
    import time

    from rlvr.scaleout.rollout import RayEngine
    from rlvr.models import load_model, load_tokenizer
    from rlvr.types import SamplingParams

    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "stuck"), "dist.rollout_workers=1"])
    model, tokenizer = load_model(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    import torch

    engine = RayEngine(cfg, model, tokenizer, workers=1, timeout_s=120, generator=torch.Generator().manual_seed(0))
    engine.timeout_s = 1.0
    try:
        # the worker is busy for many seconds: the broadcast queued behind it cannot finish in 1 s
        engine.workers[0].generate.remote([[5, 6, 7]] * 64, SamplingParams(max_new_tokens=4000, n=8),
                                                 [[1] * 8] * 64)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="weight broadcast"):
            engine.update_weights(model.state_dict())
        assert time.monotonic() - t < 10
    finally:
        engine.close()


@pytest.mark.one_precision
def test_asynchronous_rollouts_respect_the_staleness_bound(tiny_dir: Path, tmp_path: Path) -> None:
    import json

    run = [*overrides(tiny_dir, tmp_path, "async", train__steps=4), "dist.rollout_workers=1", "dist.async_rollouts.steps=1",
           "dist.async_rollouts.max_staleness=1", "dist.ray.timeout_s=120"]
    train(load_config(None, run), quiet=True)
    rows = read_metrics(tmp_path / "async")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 <= r["dist/staleness_max"] <= 1 for r in rows)
    assert any(r["dist/staleness_max"] == 1 for r in rows)  # generation did overlap an update
    samples = [json.loads(line) for line in (tmp_path / "async" / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # step k trains on weights at most one update older than the learner's (k - 1)
        assert s["step"] - 1 - s["policy_version"] in (0, 1)
    # "drop": generation runs ahead anyway, and groups staler than the bound are not trained on
    run = [*overrides(tiny_dir, tmp_path, "drop", train__steps=3), "dist.rollout_workers=1", "dist.async_rollouts.steps=1",
           "dist.async_rollouts.max_staleness=0", 'dist.async_rollouts.on_stale="drop"', "dist.ray.timeout_s=120"]
    train(load_config(None, run), quiet=True)
    rows = read_metrics(tmp_path / "drop")
    assert sum(r.get("dist/stale_dropped", 0) for r in rows) > 0
    assert all(r.get("dist/staleness_max", 0) == 0 or r.get("skipped_update") for r in rows)


@pytest.mark.one_precision
def test_partial_rollouts_respect_the_staleness_bound_from_the_first_token(tiny_dir: Path, tmp_path: Path) -> None:
    """dist.async_rollouts.partial_rollouts: a broadcast reaches the sampling under way (the switch itself is
    tested token by token in tests/test_engine.py). Whether a given sample crosses an update
    depends on timing, so this checks the bookkeeping: staleness counts from the first token."""
    import json

    run = [*overrides(tiny_dir, tmp_path, "partial", train__steps=4), "dist.rollout_workers=1",
           "dist.async_rollouts={steps = 1, max_staleness = 1, partial_rollouts = true}", "dist.ray.timeout_s=120",
           "sampling.max_new_tokens=48"]
    train(load_config(None, run), quiet=True)
    rows = read_metrics(tmp_path / "partial")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 <= r["dist/staleness_max"] <= 1 and 0 <= r["dist/partial_fraction"] <= 1 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "partial" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["step"] - 1 - s["policy_version"] in (0, 1)
        assert all(0 < t < 48 for t in s.get("swapped_at", []))


@pytest.mark.dtype_independent  # pinned to fp32
def test_two_learners_train_ppo_with_a_critic_as_one_does(tiny_dir: Path, tmp_path: Path) -> None:
    """advantage = "gae": each rank holds a critic replica; value gradients are summed like the policy's."""
    gae = ['algo.advantage="gae"', "train.micro_batch_size=4", *FP32]  # see the test above for fp32
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "one", train__steps=2), *gae]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "two", train__steps=2), *gae, "dist.learners=2",
                             "dist.ray.timeout_s=120"]), quiet=True)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        a, b = comparable(a), comparable(b)
        assert "value_loss" in a and a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def reads_a_field(prompt: str, steps: list[str], answer: object = None, **example: object) -> list[float]:
    """A function PRM that reads an example field beyond the answer: without it, its scores change."""
    return [float("entry" in example) * float(any(c.isdigit() for c in s)) for s in steps]


def fails_on_a_learner_actor(prompt: str, steps: list[str], answer: object = None, **example: object) -> list[float]:
    """A function PRM that raises on rank 1 only, leaving rank 0 waiting in a collective."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        raise RuntimeError("the PRM failed on this learner")
    return [0.5 for _ in steps]


@pytest.mark.dtype_independent  # pinned to fp32
def test_a_function_prm_sees_its_example_on_every_learner(tiny_dir: Path, tmp_path: Path) -> None:
    """Rank 1 was given the group's answer alone, so a PRM reading another field scored its
    micro-batches otherwise: the gradient differed from one learner's (grad norm 0 against 1.2)."""
    prm = ['algo.advantage="process"', "train.micro_batch_size=4", *FP32,
           'algo.advantage_kwargs={prm = "tests.test_scaleout:reads_a_field", delimiter = " "}']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "one"), *prm]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "two"), *prm, "dist.learners=2",
                             "dist.ray.timeout_s=120"]), quiet=True)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert one[0]["grad_norm"] > 0
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "process/step_score"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.one_precision
def test_a_learner_actor_that_fails_gives_its_own_error(tiny_dir: Path, tmp_path: Path) -> None:
    """Rank 0 waits in a collective for a rank that failed; when the wait ends, the error is the
    rank's own, not the process group's timeout."""
    prm = ['algo.advantage="process"', "train.micro_batch_size=4",
           'algo.advantage_kwargs={prm = "tests.test_scaleout:fails_on_a_learner_actor", delimiter = " "}']
    with pytest.raises(RuntimeError, match="learner rank 1 failed during the update(.|\n)*the PRM failed on this learner"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "fail"), *prm, "dist.learners=2",
                                 "dist.ray.timeout_s=15"]), quiet=True)


@pytest.mark.one_precision
def test_asynchronous_episodes_carry_the_version_of_their_weights(tiny_dir: Path, tmp_path: Path) -> None:
    """Multi-turn episodes (env.name) were put together without their turns' weight versions,
    read as version 0: with on_stale = "drop" every group was dropped from step 3 on."""
    import json

    env = ['env.name="guess_number"', "env.kwargs={low = 1, high = 3, max_guesses = 3}", "env.max_turns=3",
           "env.max_void_turns=3", "sampling.max_new_tokens=4", "dist.rollout_workers=1", "dist.ray.timeout_s=120",
           'dist.async_rollouts={steps = 1, max_staleness = 1, on_stale = "drop"}']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "env", train__steps=4), *env]), quiet=True)
    rows = read_metrics(tmp_path / "env")
    assert [r.get("dist/stale_dropped") for r in rows] == [0.0] * 4 and not any(r.get("skipped_update") for r in rows)
    assert all(0 <= r["dist/staleness_max"] <= 1 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "env" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["step"] - 1 - s["policy_version"] in (0, 1) for s in samples)


@pytest.mark.one_precision
def test_an_asynchronous_run_resumes_on_the_prompts_it_had_not_trained(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint waited for the collections made ahead, so it held the sampler after them: a
    resumed run skipped their prompts, and its policy versions started again from 0."""
    import json
    import shutil

    run = [*overrides(tiny_dir, tmp_path, "straight", train__steps=4), "checkpoint_every=2", "keep_checkpoints=5",
           "dist.rollout_workers=1", "dist.async_rollouts={steps = 1}", "dist.ray.timeout_s=120"]
    train(load_config(None, run), quiet=True)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000004")  # as if it stopped during step 3
    (tmp_path / "resumed" / "summary.json").unlink()
    train(resume=tmp_path / "resumed", quiet=True)

    def by_step(name: str) -> dict[int, list]:
        out: dict[int, list] = {}
        for line in (tmp_path / name / "samples.jsonl").read_text().splitlines():
            s = json.loads(line)
            out.setdefault(s["step"], []).append((s["prompt_id"], s["policy_version"]))
        return out

    straight, resumed = by_step("straight"), by_step("resumed")
    assert [p for p, _ in straight[1]] != [p for p, _ in straight[3]]
    for step in (3, 4):
        assert [p for p, _ in resumed[step]] == [p for p, _ in straight[step]], step
        assert all(step - 1 - v in (0, 1) for _, v in resumed[step])  # the versions go on from the checkpoint's
    assert read_metrics(tmp_path / "resumed")[-1]["dist/policy_version"] == 4
    # bit for bit: the checkpoint kept step 3's collection, made ahead from the older weights
    # (it used to be made again on the resumed policy); restart counts and timings aside
    assert [comparable(r) for r in read_metrics(tmp_path / "resumed")] == \
        [comparable(r) for r in read_metrics(tmp_path / "straight")]
    assert [r for r in (tmp_path / "resumed" / "samples.jsonl").read_text().splitlines()] == \
        [r for r in (tmp_path / "straight" / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("extra", "message"), [
    (["dist.async_rollouts.steps=1"], "needs dist.rollout_workers"),
    (["dist.rollout_workers=1", "dist.async_rollouts={steps = 1, max_staleness = 0}"], "never lets generation run ahead"),
    (["dist.rollout_workers=2", "dist.learners=2", "dist.ray={num_cpus = 2, cpus_per_worker = 1}"],
     "fewer than the 3 CPUs the actors reserve"),
    (["dist.async_rollouts.partial_rollouts=true"], "dist.async_rollouts: missing keyword 'steps'"),
    (["dist.async_rollouts.steps=0"], "need steps >= 1"),
    (["dist.ray.cpus_per_workers=2"], "did you mean 'cpus_per_worker'"),
    (['dist.ray.num_cpus="four"'], "dist.ray: num_cpus: Input should be a valid integer"),
    (['dist.async_rollouts={steps = 1, on_stale = "later"}'], "on_stale: Input should be 'wait' or 'drop'"),
    (["dist.async_steps=1"], "'dist.async_steps' is now dist.async_rollouts.steps"),
    (["dist.rollout_workers=1", 'engine.backend="vllm"', "dist.ray.gpus_per_worker=1",
      "dist.async_rollouts={steps = 1, partial_rollouts = true}"], "needs the embedded engine"),
])
def test_settings_that_cannot_work_are_refused(tiny_dir: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, [*overrides(tiny_dir, tmp_path, "x"), *extra])


@pytest.mark.one_precision
def test_agent_episodes_sample_on_ray_rollout_workers(tmp_path: Path) -> None:
    """Black-box agent episodes (rlvr.agents.openai_agent): the server's engine calls go to a Ray
    rollout worker (RayEngine takes per-sample seeds)."""
    from tests.test_openai_agent import ascii_tokenizer
    from tests.tiny import make_tiny_model

    tok = ascii_tokenizer()
    make_tiny_model(vocab_size=len(tok)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    train(load_config(None, [*overrides(tmp_path / "m", tmp_path, "ray", train__steps=2), 'env.name="openai_agent"',
                             'env.kwargs={entry = "tests.test_openai_agent:agent_for_training"}',
                             "env.max_total_tokens=16", "dist.rollout_workers=1", "dist.ray.timeout_s=120"]), quiet=True)
    rows = read_metrics(tmp_path / "ray")
    assert len(rows) == 2 and rows[-1]["env/turns"] == 2.0 and rows[-1]["env/ending/done"] == 1.0


def test_a_vision_language_model_is_refused_on_data_parallel_learners(tmp_path: Path) -> None:
    """The learner actors load text models only: they failed, and rank 0 waited out the timeout
    for a process group they never joined."""
    from tests.test_vlm_loop import visual_overrides
    from tests.tiny import make_tiny_vlm

    model, processor = make_tiny_vlm(seed=1)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    with pytest.raises(ValueError, match="does not train vision-language models"):
        train(load_config(None, [*visual_overrides(tmp_path / "vlm", tmp_path, "x"), "dist.learners=2",
                                 "dist.ray.timeout_s=120"]), quiet=True)
    assert not (tmp_path / "x").exists()  # nothing trained: the same name can run the corrected command


def test_with_vllm_rollout_workers_the_driver_builds_no_vllm_engine_of_its_own(tiny_dir: Path, tmp_path: Path) -> None:
    """The workers sample; the driver's engine is only the stream their seeds come from. It had
    built a whole vLLM engine of its own (GPU memory the workers could not use, and a failure on a
    driver without a GPU), which the rollout workers then replaced."""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.train.loop import setup

    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "v"), "dist.rollout_workers=1", 'engine.backend="vllm"',
                             "dist.ray.gpus_per_worker=1"])
    (tmp_path / "v").mkdir()
    run = setup(cfg, tmp_path / "v")
    assert isinstance(run.engine, EmbeddedEngine) and run.engine.model is run.learner.model


def test_an_address_for_a_ray_already_running_here_is_said_to_be_unused(caplog: pytest.LogCaptureFixture) -> None:
    """A Ray the process started already (a notebook's, this module's) cannot join another cluster;
    dist.ray.address was dropped without a word."""
    from rlvr.scaleout import start_ray

    with caplog.at_level("WARNING", logger="rlvr.scaleout"):
        assert start_ray("ray://elsewhere:10001") is ray
    assert "dist.ray.address = 'ray://elsewhere:10001' is not used" in caplog.text


@pytest.mark.one_precision
def test_a_reward_model_on_a_ray_actor_scores_as_in_process_and_a_dead_one_is_infrastructure(
        tiny_reward_model: str) -> None:
    """``ray = true`` moves the reward model into an actor of its own: the same fp32 weights and
    batches give the same scores there; an actor that died is the infrastructure's failure (the
    samples left out, never scored 0), and the next call starts another."""
    from rlvr.errors import InfrastructureError
    from rlvr.rewards import reward_model as rm

    completions = ["7", "seven", "a longer answer that says 7"]
    settings = {"model": tiny_reward_model, "dtype": "fp32"}
    here = rm.reward_model_reward("What is 3 + 4?", completions, **settings)
    there = rm.reward_model_reward("What is 3 + 4?", completions, ray=True, **settings)
    assert there == pytest.approx(here, abs=1e-6)  # fp32 in another process: the same products
    remote = next(s for s in rm._SCORERS.values() if isinstance(s, rm.RayScorer))
    assert remote.where() == "cpu float32"
    ray.kill(remote.actor)
    with pytest.raises(InfrastructureError, match="Ray actor gave no scores"):
        rm.reward_model_reward("What is 3 + 4?", completions, ray=True, **settings)
    assert rm.reward_model_reward("What is 3 + 4?", completions, ray=True, **settings) == pytest.approx(here, abs=1e-6)
