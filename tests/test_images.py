"""Images in prompts (rlvr.data.images): reading a row's image, and rendering a prompt with images
through a VLM's processor, checked on a tiny Llava built in code (tests.tiny.make_tiny_vlm)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from rlvr.data.images import image_token_ids, load_image, render_with_images, template_ids
from rlvr.data.visual import visual_examples
from tests.tiny import IMAGE, IMAGE_SIDE, PATCH, make_tiny_vlm

TOKENS_PER_IMAGE = (IMAGE_SIDE // PATCH) ** 2


def test_images_load_from_what_rows_hold(tmp_path: Path) -> None:
    picture = Image.new("RGBA", (5, 4), (10, 20, 30, 255))
    data = io.BytesIO()
    picture.save(data, format="PNG")
    (tmp_path / "a.png").write_bytes(data.getvalue())
    for value in [picture, data.getvalue(), str(tmp_path / "a.png"), tmp_path / "a.png",
                  {"bytes": data.getvalue(), "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")}]:
        image = load_image(value, "rows.jsonl:3")
        assert image.mode == "RGB" and image.size == (5, 4) and image.getpixel((0, 0)) == (10, 20, 30)
    with pytest.raises(ValueError, match="rows.jsonl:3: image file not found"):
        load_image(str(tmp_path / "missing.png"), "rows.jsonl:3")
    with pytest.raises(ValueError, match="rows.jsonl:3: cannot read the image"):
        load_image(b"not an image", "rows.jsonl:3")
    with pytest.raises(ValueError, match="must be a file path, bytes or a PIL image, got int"):
        load_image(7, "rows.jsonl:3")


def test_a_prompt_with_images_renders_to_image_tokens_and_pixels() -> None:
    model, processor = make_tiny_vlm()
    tokenizer = processor.tokenizer
    image = visual_examples("count", size=1)[0].fields["images"][0]
    ids, media = render_with_images(processor, "How many?", [image, image], system_prompt="Be brief.")
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    assert image_token_ids(processor) == {image_id}
    assert ids.count(image_id) == 2 * TOKENS_PER_IMAGE
    # the text around the images is the chat template's, tokenized as the text-only path does
    text = tokenizer.decode([i for i in ids if i != image_id])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    assert set(media) == {"pixel_values"} and tuple(media["pixel_values"].shape) == (2, 3, IMAGE_SIDE, IMAGE_SIDE)
    with pytest.raises(ValueError, match="no images"):
        render_with_images(processor, "How many?", [])
    # the template's ids, for vLLM: one placeholder per image where the processor put the image's tokens
    template = template_ids(processor, "How many?", 2, system_prompt="Be brief.")
    assert template.count(image_id) == 2
    assert [i for i in template if i != image_id] == [i for i in ids if i != image_id]


def test_the_pixels_reach_the_model() -> None:
    """The rendered ids and pixel inputs are what the model's forward takes, and its next-token
    distribution depends on the image (a wrong placement would leave it unchanged or fail)."""
    model, processor = make_tiny_vlm()
    a, b = (ex.fields["images"][0] for ex in visual_examples("locate", size=2, seed=0))
    logits = []
    for image in (a, b, a):
        ids, media = render_with_images(processor, "Where?", [image])
        logits.append(model(input_ids=torch.tensor([ids]), **media).logits[0, -1])
    torch.testing.assert_close(logits[0], logits[2])
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_a_vlm_loads_with_its_processor_and_is_refused_as_a_text_model(tmp_path: Path, tiny_dir: Path) -> None:
    from rlvr.models import is_vision_language, load_model, load_vlm

    model, processor = make_tiny_vlm()
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    assert is_vision_language(str(tmp_path / "vlm")) and not is_vision_language(str(tiny_dir))
    loaded, loaded_processor = load_vlm(str(tmp_path / "vlm"), "fp32")
    ids, media = render_with_images(loaded_processor, "Where?", [Image.new("RGB", (9, 7), (200, 0, 0))])
    torch.testing.assert_close(loaded(input_ids=torch.tensor([ids]), **media).logits,
                               model(input_ids=torch.tensor([ids]), **media).logits)
    with pytest.raises(ValueError, match="is a vision-language model: load it with load_vlm"):
        load_model(str(tmp_path / "vlm"), "fp32")
    with pytest.raises(ValueError, match="is not a vision-language model"):
        load_vlm(str(tiny_dir), "fp32")


def test_per_token_processor_outputs_are_kept_per_token() -> None:
    """A processor that returns a per-token tensor beside the pixels (Gemma 3's token_type_ids,
    Qwen2-VL's mm_token_type_ids) keeps it over the prompt's ids, for padding with each row."""
    from rlvr.data.images import prompt_media

    _, processor = make_tiny_vlm()

    class WithTokenTypes:
        chat_template = processor.chat_template
        tokenizer = processor.tokenizer

        def apply_chat_template(self, *args: object, **kwargs: object) -> object:
            return processor.apply_chat_template(*args, **kwargs)

        def __call__(self, **kwargs: object) -> dict:
            out = dict(processor(**kwargs))
            out["token_type_ids"] = (out["input_ids"] == processor.tokenizer.convert_tokens_to_ids(IMAGE)).long()
            return out

    image = Image.new("RGB", (8, 8))
    ids, inputs = render_with_images(WithTokenTypes(), "How many?", [image])
    media = prompt_media([image], inputs, len(ids))
    assert set(media.inputs) == {"pixel_values"} and set(media.tokens) == {"token_type_ids"}
    assert int(media.tokens["token_type_ids"].sum()) == TOKENS_PER_IMAGE and len(media.tokens["token_type_ids"]) == len(ids)
