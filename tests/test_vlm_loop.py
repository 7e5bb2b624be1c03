"""A vision-language model through the engine and the learner: prompts with images are prefilled
with their pixel inputs, and the learner's log-probs of the sampled tokens (whole rows, and with
the prompt shared by its group) equal the engine's. On a tiny Llava built in code
(tests.tiny.make_tiny_vlm), in float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.config import load_config
from rlvr.data.images import batched_inputs, image_token_ids, prompt_media, render_with_images
from rlvr.data.visual import visual_examples
from rlvr.models import load_vlm
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.batches import collate, sample_logprobs
from rlvr.train.loop import train
from rlvr.train.settings import Passes, UpdateSettings
from rlvr.types import PromptMedia, Sample, SamplingParams
from tests.test_train import TIMING, overrides, read_metrics
from tests.tiny import IMAGE, make_tiny_qwen2_vl, make_tiny_vlm

# The engine's tokens are scored once incrementally (prefill, then one token at a time from the
# cache) and once over whole rows; in float32 the two summation orders differ by ~1e-6 per
# log-prob on this model, and the text engine's tests hold them to 1e-4 for the same reason.
ATOL = 1e-4


@pytest.fixture(scope="module", params=["llava", "qwen2-vl"])
def vlm(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    """A Llava (1-D positions, pixel inputs only) and a Qwen2-VL (3-D image positions and a
    per-token input, ``mm_token_type_ids``)."""
    return make_tiny_vlm(seed=1) if request.param == "llava" else make_tiny_qwen2_vl(seed=1)


def prompts_with_images(processor: Any, count: int = 3, seed: int = 0) -> tuple[list[list[int]], list[PromptMedia]]:
    """Rendered count-task prompts (one image each), the last with its image twice: prompts of
    different lengths, so the engine left-pads and the learner right-pads."""
    ids, media = [], []
    for k, ex in enumerate(visual_examples("count", size=count, seed=seed)):
        images = ex.fields["images"] * (2 if k == count - 1 else 1)
        row, inputs = render_with_images(processor, ex.prompt, images)
        ids.append(row)
        media.append(prompt_media(images, inputs, len(row)))
    return ids, media


def test_the_engine_samples_from_the_image(vlm: tuple[Any, Any]) -> None:
    """Same ids, same seeds, different pixels: different next-token distributions, so different
    log-probs (a prefill that dropped the pixel inputs would fail in the model or give equal ones)."""
    model, processor = vlm
    engine = EmbeddedEngine(model, processor.tokenizer, eos_token_ids=[processor.tokenizer.eos_token_id])
    assert engine.decoder == "hf"
    a, b = (ex.fields["images"] for ex in visual_examples("count", size=2, seed=0))
    rendered = [render_with_images(processor, "How many?", images) for images in (a, b)]
    assert rendered[0][0] == rendered[1][0]  # the same question on two images: the same ids
    ids = [rendered[0][0]] * 2
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=2)
    out = engine.generate(ids, params, seeds=[[5, 6], [5, 6]],
                          media=[prompt_media(a, rendered[0][1], len(ids[0])), prompt_media(b, rendered[1][1], len(ids[0]))])
    # the first token's log-prob: ~0.1-1.7 nats apart on these models; the same prompt twice in a
    # batch differs only by summation order across BLAS threads (~5e-7 seen in fp32 at 2 threads)
    assert abs(out[0][0].logprobs[0] - out[1][0].logprobs[0]) > 1e-2
    same = prompt_media(a, rendered[0][1], len(ids[0]))
    again = engine.generate(ids, params, seeds=[[5, 6], [5, 6]], media=[same, same])
    assert again[0][0].logprobs[0] == pytest.approx(again[1][0].logprobs[0], abs=1e-5)


@pytest.mark.parametrize("share", [False, True], ids=["whole-rows", "shared-prompts"])
def test_learner_logprobs_equal_the_engines(vlm: tuple[Any, Any], share: bool) -> None:
    model, processor = vlm
    tokenizer = processor.tokenizer
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id], max_batch_size=4, seed=2)
    ids, media = prompts_with_images(processor)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    out = engine.generate(ids, params, media=media)  # 3 prompts × 2 samples, 2 prompts per chunk
    samples = [Sample(tuple(p), c, 0.0, {}, i, media=m) for i, (p, m, group) in enumerate(zip(ids, media, out))
               for c in group]
    settings = UpdateSettings(passes=Passes(share_prompts=share, micro_batch_size=len(samples)))
    batch = collate(samples, tokenizer.pad_token_id, torch.device("cpu"))
    images_BT = torch.isin(batch["input_ids"], torch.tensor(sorted(image_token_ids(processor))))
    assert images_BT.any() and not (images_BT & batch["loss_mask"]).any()  # image tokens are never trained
    with torch.no_grad():
        logprobs_BT, _ = sample_logprobs(model, samples, batch, settings, tokenizer.pad_token_id)
    for row, s in enumerate(samples):
        learner = logprobs_BT[row][batch["completion_mask"][row]]
        torch.testing.assert_close(learner, torch.tensor(s.completion.logprobs, dtype=learner.dtype), atol=ATOL, rtol=0)
    # the pixels reach the learner: the same rows scored with another prompt's images differ
    moved = [Sample(s.prompt_ids, s.completion, 0.0, {}, s.prompt_index,
                    media=PromptMedia(s.media.images, media[(s.prompt_index + 1) % 2].inputs, s.media.tokens)
                    if s.prompt_index < 2 else s.media) for s in samples]
    with torch.no_grad():
        other_BT, _ = sample_logprobs(model, moved, batch, settings, tokenizer.pad_token_id)
    assert not torch.allclose(other_BT[:4], logprobs_BT[:4], atol=1e-3)


def test_batched_inputs_join_prompts_in_row_order() -> None:
    a = PromptMedia((), {"pixel_values": torch.zeros(1, 3, 2, 2), "grid": torch.tensor([[1, 2, 3]])})
    b = PromptMedia((), {"pixel_values": torch.ones(2, 3, 2, 2), "grid": torch.tensor([[4, 5, 6], [7, 8, 9]])})
    joined = batched_inputs([a, None, b], dtype=torch.float64)
    assert joined["pixel_values"].dtype == torch.float64 and joined["grid"].dtype == torch.long
    assert joined["pixel_values"][:, 0, 0, 0].tolist() == [0.0, 1.0, 1.0]
    assert joined["grid"].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert batched_inputs([None, None]) == {}
    with pytest.raises(ValueError, match="different image inputs"):
        batched_inputs([a, PromptMedia((), {"pixel_values": torch.zeros(1, 3, 2, 2)})])
    with pytest.raises(ValueError, match="cannot be joined"):
        batched_inputs([a, PromptMedia((), {"pixel_values": torch.zeros(1, 3, 4, 4), "grid": torch.tensor([[1, 1, 1]])})])
    # per-token inputs follow each row's layout: left-padded (the engine) or from column 0 (the learner)
    c = prompt_media((), {"pixel_values": torch.zeros(1, 3, 2, 2), "kind": torch.tensor([[0, 1, 1]])}, length=3)
    assert set(c.inputs) == {"pixel_values"} and c.tokens["kind"].tolist() == [0, 1, 1]
    assert batched_inputs([c, None, c], starts=[2, 0, 0], width=5)["kind"].tolist() == [
        [0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    with pytest.raises(ValueError, match="need the rows' layout"):
        batched_inputs([c])


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llava and its processor saved as a Hugging Face folder, for `model = <path>` runs."""
    path = tmp_path_factory.mktemp("tiny_vlm")
    model, processor = make_tiny_vlm(seed=1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def visual_overrides(vlm_dir: Path, out: Path, name: str, **extra: object) -> list[str]:
    cfg = {"task.source": '"visual"', "task.name": '"count"', "task.params": "{max_shapes = 4}",
           "task.instruction": '"Answer with the number."'}
    cfg.update({k.replace("__", "."): v for k, v in extra.items()})
    return overrides(vlm_dir, out, name, **{k.replace(".", "__"): v for k, v in cfg.items()})


def test_grpo_on_images_trains_the_vision_part_and_resumes_exactly(vlm_dir: Path, tmp_path: Path) -> None:
    """Two GRPO steps on the synthetic count task: the parameters change, the vision tower's and
    projector's included (their gradient reaches them only through the pixel inputs of the
    learner's forward); the checkpoint loads back as a VLM with its processor; a run stopped
    after step 1 and resumed repeats step 2 exactly, a group replayed from the checkpoint's
    buffer included (the checkpoint keeps its ids; its images come back from the task)."""
    replay = {"sampler__replay": "{fraction = 0.5}"}
    summary = train(load_config(None, visual_overrides(vlm_dir, tmp_path, "vlm", **replay)), quiet=True)
    assert summary is not None
    rows = read_metrics(tmp_path / "vlm")
    assert len(rows) == 2 and all(r["zero_std_fraction"] < 1 for r in rows)
    assert rows[1]["replay/groups"] >= 1
    before, _ = load_vlm(str(vlm_dir), "float32")
    after, processor = load_vlm(str(tmp_path / "vlm" / "checkpoints" / "step_000002"), "float32")
    changed = {name.split(".")[1] for (name, a), b in zip(before.named_parameters(), after.parameters())
               if not torch.equal(a, b)}
    assert {"vision_tower", "multi_modal_projector", "language_model"} <= changed, changed
    assert image_token_ids(processor) == {processor.tokenizer.convert_tokens_to_ids(IMAGE)}
    # the rollout browser shows each prompt's image: a thumbnail per prompt, inlined in the report
    logged = [json.loads(line) for line in (tmp_path / "vlm" / "samples.jsonl").read_text().splitlines()]
    assert all(len(r["images"]) == 1 and (tmp_path / "vlm" / r["images"][0]).is_file() for r in logged)
    html = (tmp_path / "vlm" / "report.html").read_text()
    prompts = {(r["step"], r["prompt_id"]) for r in logged}
    assert html.count("data:image/png;base64,") == len(prompts)
    train(load_config(None, visual_overrides(vlm_dir, tmp_path, "vlm2", train__steps=1, **replay)), quiet=True)
    train(resume=tmp_path / "vlm2", overrides=("train.steps=2",), quiet=True)
    resumed = read_metrics(tmp_path / "vlm2")
    assert {k: v for k, v in resumed[1].items() if k not in TIMING} == {k: v for k, v in rows[1].items() if k not in TIMING}


def test_image_prompts_need_a_vision_language_model(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the prompt has images.*text-only model"):
        train(load_config(None, visual_overrides(tiny_dir, tmp_path, "text")), quiet=True)


def test_a_held_out_question_is_asked_again_of_other_images(vlm_dir: Path, tmp_path: Path) -> None:
    """The count task asks one of a few questions of many images: holding out a question's text
    must not remove every training image it is asked of (the held-out set is by text and image)."""
    from rlvr.train.data import load_examples

    cfg = load_config(None, visual_overrides(vlm_dir, tmp_path, "split", task__size=40, task__eval_size=8))
    train_examples, held = load_examples(cfg)
    assert len(held) == 8 and len(train_examples) == 40
    assert {ex.prompt for ex in held} & {ex.prompt for ex in train_examples}  # same texts, other images


def test_jsonl_rows_with_an_image_column_render_with_their_images(vlm_dir: Path, tmp_path: Path) -> None:
    """task.source = "jsonl" with task.params.image_column: relative paths are read from the
    file's folder, a row may hold a list of images, a row without images renders as text, and a
    missing file names its row."""
    import json

    from rlvr.models import load_processor
    from rlvr.train.data import load_task

    for k, ex in enumerate(visual_examples("count", size=3, seed=4)):
        ex.fields["images"][0].save(tmp_path / f"{k}.png")
    rows = [{"question": "How many red shapes?", "answer": "1", "picture": "0.png"},
            {"question": "How many blue shapes?", "answer": "2", "picture": ["1.png", str(tmp_path / "2.png")]},
            {"question": "Say 3.", "answer": "3", "picture": None},
            {"question": "How many green shapes?", "answer": "0", "picture": "0.png"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = load_processor(str(vlm_dir))
    image = processor.tokenizer.convert_tokens_to_ids(IMAGE)
    cfg = load_config(None, visual_overrides(vlm_dir, tmp_path, "rows", task__source='"jsonl"',
                                             task__path=f'"{tmp_path / "rows.jsonl"}"', task__size=3, task__eval_size=1,
                                             task__params='{prompt_column = "question", image_column = "picture"}'))
    task = load_task(cfg, processor.tokenizer, [], processor)
    assert task.eval_media is not None and task.media is not None
    everything = list(zip(task.eval_ids + task.prompt_ids, task.eval_media + task.media))
    assert [ids.count(image) for ids, _ in everything] == [16, 32, 0, 16]
    assert [None if m is None else len(m.images) for _, m in everything] == [1, 2, None, 1]
    rows[3]["picture"] = "missing.png"
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"rows.jsonl:4: image 0: image file not found: missing.png"):
        load_task(cfg, processor.tokenizer, [], processor)
    with pytest.raises(ValueError, match="no 'image' column"):
        load_task(load_config(None, visual_overrides(vlm_dir, tmp_path, "rows", task__source='"jsonl"',
                                                     task__path=f'"{tmp_path / "rows.jsonl"}"',
                                                     task__params='{prompt_column = "question", image_column = "image"}')),
                  processor.tokenizer, [], processor)


def test_rlvr_eval_takes_a_vision_language_model(vlm_dir: Path, tmp_path: Path) -> None:
    """`rlvr eval` on a VLM: its held-out prompts are sampled with their images (pass@k, and the
    token entropy scored with the pixel inputs too)."""
    from rlvr.eval.run import evaluate_model

    cfg = load_config(None, visual_overrides(vlm_dir, tmp_path, "eval"))
    result = evaluate_model(str(vlm_dir), cfg, n=2, ks=[1, 2], prompts=3, temperature=1.0, max_new_tokens=4)
    assert result["prompts"] == 3 and 0 <= result["pass@1"] <= result["pass@2"] <= 1
    assert result["response_length"] > 0 and result["token_entropy"] > 0


def test_the_report_inlines_only_the_runs_own_thumbnails(tmp_path: Path) -> None:
    from rlvr.report import rollouts

    (tmp_path / "images").mkdir()
    name = "images/" + "a" * 40 + ".png"
    (tmp_path / name).write_bytes(b"png")
    (tmp_path / "secret.png").write_bytes(b"secret")
    rows = [{"step": 1, "prompt_id": "p", "prompt": "x", "completion": "y", "reward": 0, "images": [name, "secret.png",
                                                                                                     "images/../secret.png"]}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups, _ = rollouts(tmp_path, 10)
    assert groups[1][0]["images"] == ["data:image/png;base64,cG5n"]


def test_mixed_families_are_scored_by_their_own_rewards(vlm_dir: Path, tmp_path: Path) -> None:
    """docs/vlm.md's routing: with task.name = "mixed", each example goes to the reward of its
    family (the `task` field), and every reward scores only its own family's samples."""
    routed = ('[{fn = "exact_answer", sources = ["count", "digits"]}, {fn = "multiple_choice", sources = ["compare"]},'
              ' {fn = "iou", sources = ["locate"]}]')
    cfg = load_config(None, visual_overrides(vlm_dir, tmp_path, "mixed", task__name='"mixed"', rewards=routed,
                                             train__steps=1, train__prompts_per_step=8, task__params="{}"))
    train(cfg, quiet=True)
    logged = [json.loads(line) for line in (tmp_path / "mixed" / "samples.jsonl").read_text().splitlines()]
    expected = {"count": "exact_answer", "digits": "exact_answer", "compare": "multiple_choice", "locate": "iou"}
    family = {ex.id: ex.fields["task"] for ex in visual_examples("mixed", size=cfg.task.size + cfg.task.eval_size,
                                                                 seed=cfg.seed)}
    for row in logged:
        assert set(row["rewards"]) == {expected[family[row["prompt_id"]]]}, row
    assert len({family[row["prompt_id"]] for row in logged}) >= 2  # the eight prompts came from several families


def test_parquet_rows_with_image_bytes_render(vlm_dir: Path, tmp_path: Path) -> None:
    """A Parquet file as `datasets` writes an Image column: {"bytes", "path"} structs."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlvr.models import load_processor
    from rlvr.train.data import load_task

    pictures = []
    for ex in visual_examples("digits", size=3, seed=2):
        data = io.BytesIO()
        ex.fields["images"][0].save(data, format="PNG")
        pictures.append({"bytes": data.getvalue(), "path": None})
    table = pa.table({"prompt": ["What number?"] * 3, "answer": ["1", "2", "3"], "image": pictures})
    pq.write_table(table, tmp_path / "rows.parquet")
    processor = load_processor(str(vlm_dir))
    cfg = load_config(None, visual_overrides(vlm_dir, tmp_path, "pq", task__source='"parquet"',
                                             task__path=f'"{tmp_path / "rows.parquet"}"', task__size=2, task__eval_size=1,
                                             task__params='{image_column = "image"}'))
    task = load_task(cfg, processor.tokenizer, [], processor)
    assert task.media is not None and all(m is not None and m.images[0].size == (128, 128) for m in task.media)


def test_the_engine_never_samples_an_image_placeholder(vlm: tuple[Any, Any]) -> None:
    """A completion holding an image token would stand for an image nobody gave (and the
    learner's forward would fail on it). With the placeholder's logit pushed up by 30, an engine
    that bans it samples none (and still valid log-probs); one that does not, mostly that token."""
    model, processor = vlm
    tokenizer = processor.tokenizer
    image = sorted(image_token_ids(processor))
    ids, media = prompts_with_images(processor, count=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    head = model.get_output_embeddings()
    push = head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor(image), torch.full((*out.shape[:-1], len(image)), 30.0, dtype=out.dtype)))
    try:
        free = EmbeddedEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id])
        banned = EmbeddedEngine(model, tokenizer, eos_token_ids=[tokenizer.eos_token_id], banned_token_ids=image)
        loose = [t for g in free.generate(ids, params, media=media) for c in g for t in c.token_ids]
        kept = [c for g in banned.generate(ids, params, media=media) for c in g]
    finally:
        push.remove()
    assert sum(t in image for t in loose) > len(loose) // 2
    assert not any(t in image for c in kept for t in c.token_ids)
    assert all(len(c.token_ids) > 0 and all(lp > -50 for lp in c.logprobs) for c in kept)


def test_what_does_not_take_images_yet_says_so() -> None:
    """A critic would score image-token ids without their pixels: refused, not silently wrong."""
    from rlvr.train.critic import Critic

    with pytest.raises(ValueError, match="critic .* vision-language model is not supported yet"):
        Critic(make_tiny_vlm()[0])


def test_a_rehearsal_set_read_back_gets_its_images(tmp_path: Path) -> None:
    """DPH-RL's rehearsal file keeps ids, not images; read back (every resume), its samples get
    their prompts' images from the task, or their divergence would be scored without pixels."""
    from types import SimpleNamespace

    from rlvr.train.methods.rehearsal import Rehearsal, screen
    from rlvr.types import Completion

    a = PromptMedia((), {"pixel_values": torch.zeros(1, 3, 2, 2)})
    b = PromptMedia((), {"pixel_values": torch.ones(1, 3, 2, 2)})
    sample = Sample((1, 2), Completion((3,), (-0.5,), "stop", "x"), 1.0, {}, 1, media=b)
    Rehearsal([sample], screened=2).save(tmp_path)
    run = SimpleNamespace(dir=tmp_path, task=SimpleNamespace(media=[a, b]))
    assert screen(run, None, None).samples[0].media is b  # type: ignore[arg-type]
