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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from rlvr.types import PromptMedia


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
    per_token = sorted(k for k, v in media.items() if v.dim() == 2 and tuple(v.shape) == (1, len(ids)))
    if per_token:  # e.g. Gemma 3's token_type_ids: they would have to follow each row's padding
        raise ValueError(f"{where}: the processor returns per-token inputs ({', '.join(per_token)}), which rlvr "
                         "does not pad and pass along yet; models whose processors return only pixel inputs "
                         "(Llava, SmolVLM without image splitting) work (docs/vlm.md)")
    return ids, media


def batched_inputs(media: Sequence[PromptMedia | None], device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The pixel inputs of a batch of prompts for one forward: each prompt's inputs (batch of one
    prompt each) joined along the first dimension in row order, prompts without images skipped.
    That is how the models whose processors give one entry per image (Llava, Gemma 3) or per
    image patch (Qwen2-VL's ``pixel_values`` with its ``image_grid_thw``) read a batch: the
    image features fill the ids' image tokens in row-major order. Floating-point inputs take ``dtype`` (the model's), others
    keep theirs. Empty for a text-only batch."""
    present = [m.inputs for m in media if m is not None]
    if not present:
        return {}
    keys = set(present[0])
    if any(set(inputs) != keys for inputs in present):
        raise ValueError(f"prompts in one batch carry different pixel inputs: {sorted(keys)} vs "
                         f"{sorted(next(set(i) for i in present if set(i) != keys))}")
    out = {}
    for key in sorted(keys):
        parts = [inputs[key] for inputs in present]
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            raise ValueError(f"pixel input {key!r} has shapes {sorted({tuple(p.shape) for p in parts})} across the "
                             "batch's prompts and cannot be joined (a processor that pads per batch, e.g. to a "
                             "common number of images, needs prompts with the same number of images)")
        joined = torch.cat(parts)
        out[key] = joined.to(device=device, dtype=dtype if dtype is not None and joined.is_floating_point() else None)
    return out


def refuse_3d_positions(model: Any) -> None:
    """A ValueError for a model that places image tokens on 3-D rotary positions it computes
    itself (Qwen2-VL and its successors: ``get_rope_index``). rlvr's engine and learner pass
    positions counted over a row's real tokens, right for 1-D rotary models (Llava, SmolVLM,
    Gemma 3) and wrong for these, whose image tokens share positions along a grid."""
    inner = getattr(model, "model", model)
    if hasattr(model, "get_rope_index") or hasattr(inner, "get_rope_index"):
        raise ValueError(f"{type(model).__name__} places image tokens on 3-D rotary positions (get_rope_index), "
                         "which rlvr's embedded engine and learner do not compute yet; models with 1-D positions "
                         "(Llava, SmolVLM, Gemma 3) work (docs/vlm.md)")


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
