"""Images in prompts: reading them from what a dataset row holds, and rendering a prompt with images
through a vision-language model's processor.

A row's image may be a file path, raw bytes, a PIL image, or what a `datasets` Image column
gives (a PIL image, or ``{"bytes": ..., "path": ...}``); `load_image` turns each into an RGB PIL
image, or says which row and what it got. `render_with_images` places the images in the user
turn as the processor's chat template expects (``{"type": "image"}`` parts before the text) and
returns the prompt's token ids, the image tokens expanded by the processor, together with the
pixel inputs the model's forward takes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image


def load_image(value: Any, where: str) -> Image.Image:
    """An RGB PIL image from a path (str or Path), bytes, a PIL image or a `datasets` Image
    value ({"bytes", "path"}); a ValueError naming ``where`` for anything else or an unreadable file."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, bytes | bytearray):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str | Path):
            if not Path(value).is_file():
                raise ValueError(f"{where}: image file not found: {value}")
            image = Image.open(value)
        else:
            raise ValueError(f"{where}: an image must be a file path, bytes or a PIL image, got {type(value).__name__}")
        image.load()
    except (OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"{where}: cannot read the image: {err}") from None
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")  # transparency over white, not over black as a plain conversion gives
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB") if image.mode != "RGB" else image


def image_messages(prompt: str, images: list[Image.Image], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of a prompt with images: the images as ``{"type": "image"}`` parts, then
    the text, in one user turn (after the system turn, if any)."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    return messages


def render_with_images(processor: Any, prompt: str, images: list[Any], system_prompt: str | None = None,
                       where: str = "prompt") -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt with images as the model takes it: (token ids ending with the assistant turn's
    header, the pixel inputs), where the ids hold the processor's image tokens and the pixel
    inputs are every other tensor the processor returns (``pixel_values``, and e.g.
    ``image_grid_thw`` or ``pixel_attention_mask`` for the models that use them), batch of one."""
    if not images:
        raise ValueError(f"{where}: no images: a prompt without images is rendered by its tokenizer")
    if not getattr(processor, "chat_template", None):
        raise ValueError(f"{where}: the processor has no chat template to place the images in")
    pictures = [load_image(image, f"{where}: image {i}") for i, image in enumerate(images)]
    text = processor.apply_chat_template(image_messages(prompt, pictures, system_prompt), add_generation_prompt=True,
                                         tokenize=False)
    encoded = processor(images=pictures, text=text, return_tensors="pt", add_special_tokens=False)
    ids = [int(i) for i in encoded["input_ids"][0]]
    media = {k: v for k, v in encoded.items()
             if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)}
    if not media:
        raise ValueError(f"{where}: the processor returned no pixel inputs for {len(pictures)} image(s)")
    return ids, media


def image_token_ids(processor: Any) -> set[int]:
    """The token ids that stand for image content in a processor's prompts (never trained)."""
    tokenizer = processor.tokenizer
    out = set()
    for name in ("image_token_id", "image_token", "boi_token", "eoi_token", "video_token"):
        value = getattr(processor, name, None)
        if isinstance(value, int):
            out.add(value)
        elif isinstance(value, str) and value:
            token = tokenizer.convert_tokens_to_ids(value)
            if isinstance(token, int) and token != tokenizer.unk_token_id:
                out.add(token)
    return out
