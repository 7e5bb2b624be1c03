"""Sharded learners (dist.sharding = "fsdp": FSDP2 over gloo, rlvr.scaleout.sharded) on a local Ray:
two ranks give the single process's update; LoRA and activation checkpointing compose with
them; a sharded checkpoint resumes on another number of ranks; each rank holds its share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray", reason="rlvr.scaleout needs Ray (pip install 'rlvr[ray]')")

from rlvr.config import load_config  # noqa: E402
from rlvr.errors import RunDirError  # noqa: E402
from rlvr.train.loop import train  # noqa: E402
from tests.test_scaleout import comparable  # noqa: E402
from tests.test_train import FP32, overrides, read_metrics  # noqa: E402

FSDP = ['dist.sharding="fsdp"', "dist.ray.timeout_s=120"]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> object:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def same_losses(a_rows: list[dict], b_rows: list[dict]) -> None:
    """fp32: the ranks sum each gradient in another order (a reduce-scatter over shares, times the
    world size after FSDP2's average: a power of two), which fp32 rounds at ~1e-7 relative; Adam's
    normalised steps carry that into the next step's numbers at about the same size."""
    for a, b in zip(a_rows, b_rows, strict=True):
        a, b = comparable(a), comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.dtype_independent  # pinned to fp32
@pytest.mark.parametrize("extra", [[], ["lora.rank=4", "train.activation_checkpointing=true", "train.lr=1e-2"]],
                         ids=["full", "lora-checkpointing"])
def test_two_sharded_learners_give_the_local_update(tiny_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    # 3 micro-batches a step on 2 ranks: rank 1 runs an idle pass to keep the weight gathers in step
    base = [*overrides(tiny_dir, tmp_path, "local", train__steps=3), "train.micro_batch_size=6", *FP32, *extra]
    train(load_config(None, base), quiet=True)
    sharded = [*overrides(tiny_dir, tmp_path, "fsdp", train__steps=3), "train.micro_batch_size=6", *FP32, *extra,
               "dist.learners=2", *FSDP]
    train(load_config(None, sharded), quiet=True)
    local, dist = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "fsdp")
    assert [r["step"] for r in dist] == [1, 2, 3] and dist[-1]["grad_norm"] > 0
    same_losses(local, dist)
    # the driver's policy of record is the ranks' gathered weights: the checkpoints agree
    a = load_file(tmp_path / "local" / "checkpoints" / "step_000003" / "model.safetensors")
    b = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000003" / "model.safetensors")
    first = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000000" / "model.safetensors")
    assert a.keys() == b.keys() and any(not (b[k] == first[k]).all() for k in b)  # it trained
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-4 * max(1.0, float(a[k].abs().max())), k


@pytest.mark.dtype_independent  # pinned to fp32
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tiny_dir: Path, tmp_path: Path) -> None:
    """Two ranks for two steps, then three ranks from that checkpoint for two more: the same
    numbers as four steps on two ranks (the optimizer's moments were resharded, not reset)."""
    common = ["train.micro_batch_size=4", *FP32, *FSDP]
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "whole", train__steps=4), *common, "dist.learners=2"]),
          quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "cut", train__steps=2), *common, "dist.learners=2"]),
          quiet=True)
    shards = tmp_path / "cut" / "checkpoints" / "step_000002" / "learner_shards"
    assert shards.is_dir() and any(shards.glob("*.distcp"))
    with pytest.raises(RunDirError, match="sharded over 2 learner ranks"):  # not onto replicated learners
        train(resume=tmp_path / "cut", overrides=("train.steps=4", 'dist.sharding="replicas"'), quiet=True)
    train(resume=tmp_path / "cut", overrides=("train.steps=4", "dist.learners=3"), quiet=True)
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    same_losses(whole, resumed)


@pytest.mark.one_precision
def test_each_rank_holds_its_share(tiny_dir: Path, tmp_path: Path) -> None:
    """fp32 AdamW: 12 bytes a weight whole (the weight and two moments); each of two ranks holds
    half, and a little more where a tensor's rows do not split evenly (FSDP2 pads the last share)."""
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "mem", train__steps=1), *FP32, "dist.learners=2", *FSDP])
    train(cfg, quiet=True)
    weights = load_file(tmp_path / "mem" / "checkpoints" / "step_000001" / "model.safetensors")
    whole = 12 * sum(t.numel() for t in weights.values())
    held = read_metrics(tmp_path / "mem")[-1]["dist/learner_bytes_per_rank"]
    assert whole / 2 <= held <= 0.55 * whole


@pytest.mark.one_precision
def test_in_bf16_the_shares_are_fp32_masters(tiny_dir: Path, tmp_path: Path) -> None:
    """bf16: each rank keeps fp32 shares and computes with them gathered as bf16 (the values the
    local learner's bf16 weights hold: its fp32 masters rounded), and reduces gradients in fp32
    where the local learner keeps bf16 ones. The first step's gradient norm therefore differs by
    bf16's rounding of each gradient element (2^-9 relative), accumulated over 3 micro-batches:
    within 1%. Both runs sample with the fast numerics: a single learner would otherwise match the
    engine's numbers to its own (rlvr.rollout.matched), which sharded learners do not, and sample
    other tokens."""
    bf16 = ['train.precision="bf16"', 'engine.dtype="bfloat16"', "train.micro_batch_size=6", 'engine.numerics="fast"']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "local", train__steps=2), *bf16]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "fsdp", train__steps=2), *bf16, "dist.learners=2", *FSDP]),
          quiet=True)
    local, dist = read_metrics(tmp_path / "local"), read_metrics(tmp_path / "fsdp")
    assert dist[0]["grad_norm"] == pytest.approx(local[0]["grad_norm"], rel=1e-2)
    state = torch.load(tmp_path / "fsdp" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    weights = load_file(tmp_path / "fsdp" / "checkpoints" / "step_000002" / "model.safetensors")
    masters = state["learner"]["masters"]
    assert all(m.dtype == torch.float32 for m in masters)
    # the driver's masters are the ranks' fp32 weights, of which its bf16 weights are the rounding
    assert any((m != m.bfloat16().float()).any() for m in masters)
    embed = next(m for m in masters if m.shape == weights["model.embed_tokens.weight"].shape)
    assert (embed.bfloat16() == weights["model.embed_tokens.weight"]).all()


@pytest.mark.dtype_independent  # pinned to fp32
def test_ppo_on_sharded_learners_keeps_the_driver_critic_in_step(tiny_dir: Path, tmp_path: Path) -> None:
    """advantage = "gae": each rank holds a critic replica (its gradients summed like replicated
    learners'), and rank 0's critic comes back to the driver after each update, which checkpoints it."""
    gae = ['algo.advantage="gae"', "train.micro_batch_size=4", *FP32]
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "one", train__steps=2), *gae]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "two", train__steps=2), *gae, "dist.learners=2", *FSDP]),
          quiet=True)
    same_losses(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"))
    a = torch.load(tmp_path / "one" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)["critic"]
    b = torch.load(tmp_path / "two" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)["critic"]
    for k, v in a["model"].items():
        assert (v - b["model"][k]).abs().max() <= 1e-4 * max(1.0, float(v.abs().max())), k
