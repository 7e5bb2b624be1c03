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

import inspect
import io
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from rlvr.types import PromptMedia, Sample


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


def image_messages(prompt: str, images: Sequence[object], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat messages of a prompt with images: the images as ``{"type": "image"}`` parts, then
    the text, in one user turn (after the system turn, if any)."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": prompt}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
    return messages


def _chat_text(processor: Any, prompt: str, images: int, system_prompt: str | None) -> str:
    """The prompt with `images` image parts through the processor's chat template, as text."""
    return str(processor.apply_chat_template(image_messages(prompt, [None] * images, system_prompt),
                                             add_generation_prompt=True, tokenize=False))


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
    text = _chat_text(processor, prompt, len(pictures), system_prompt)
    encoded = processor(images=pictures, text=text, return_tensors="pt", add_special_tokens=False)
    ids = [int(i) for i in encoded["input_ids"][0]]
    media = {k: v for k, v in encoded.items()
             if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)}
    if not media:
        raise ValueError(f"{where}: the processor returned no pixel inputs for {len(pictures)} image(s)")
    return ids, media


def template_ids(processor: Any, prompt: str, images: int, system_prompt: str | None = None) -> list[int]:
    """The ids of the prompt that `render_with_images` renders, as its chat template writes them:
    one placeholder token per image (``<image>``, Qwen2-VL's ``<|image_pad|>``), not yet expanded
    into each image's tokens by the processor (`PromptMedia.template_ids`, what vLLM takes)."""
    text = _chat_text(processor, prompt, images, system_prompt)
    return [int(i) for i in processor.tokenizer(text, add_special_tokens=False)["input_ids"]]


def with_prompt_media(samples: Sequence[Sample], media: Sequence[PromptMedia | None]) -> list[Sample]:
    """The samples with their prompts' images (`TaskData.media`, by prompt index), for samples
    read back from a file or checkpoint, which keeps a sample's ids but not its pixels."""
    return [dataclasses.replace(x, media=media[x.prompt_index]) for x in samples]


def prompt_media(images: Sequence[Any], inputs: Mapping[str, torch.Tensor], length: int,
                 template: Sequence[int] = ()) -> PromptMedia:
    """A prompt's `PromptMedia` from what `render_with_images` returned for its ``length`` ids:
    tensors of shape (1, length) are per-token inputs (Qwen2-VL's ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``), the others pixel inputs. ``template``: its `template_ids`."""
    tokens = {k: v[0] for k, v in inputs.items() if v.dim() == 2 and tuple(v.shape) == (1, length)}
    return PromptMedia(tuple(images), {k: v for k, v in inputs.items() if k not in tokens}, tokens,
                       tuple(int(i) for i in template))


def batched_inputs(media: Sequence[PromptMedia | None], device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None, *, starts: Sequence[int] | None = None,
                   width: int | None = None) -> dict[str, torch.Tensor]:
    """The image inputs of a batch of rows for one forward: each prompt's pixel inputs (batch of
    one prompt each) joined along the first dimension in row order, rows without images skipped.
    That is how the models whose processors give one entry per image (Llava, Gemma 3) or per
    image patch (Qwen2-VL's ``pixel_values`` with its ``image_grid_thw``) read a batch: the
    image features fill the ids' image tokens in row-major order. Per-token inputs are laid out
    as [rows, ``width``], row i's prompt from column ``starts[i]`` (its left padding in the
    engine, 0 in the learner's right-padded rows), zeros elsewhere (text, completions, padding).
    Floating-point inputs take ``dtype`` (the model's), others keep theirs. Empty for a text-only
    batch."""
    present = [m for m in media if m is not None]
    if not present:
        return {}
    keys, token_keys = set(present[0].inputs), set(present[0].tokens)
    for entry in present:
        if set(entry.inputs) != keys or set(entry.tokens) != token_keys:
            raise ValueError(f"prompts in one batch carry different image inputs: {sorted(keys | token_keys)} vs "
                             f"{sorted(set(entry.inputs) | set(entry.tokens))}")
    out = {}
    for key in sorted(keys):
        parts = [entry.inputs[key] for entry in present]
        if any(p.shape[1:] != parts[0].shape[1:] for p in parts):
            raise ValueError(f"pixel input {key!r} has shapes {sorted({tuple(p.shape) for p in parts})} across the "
                             "batch's prompts and cannot be joined (a processor that pads per batch, e.g. to a "
                             "common number of images, needs prompts with the same number of images)")
        joined = torch.cat(parts)
        out[key] = joined.to(device=device, dtype=dtype if dtype is not None and joined.is_floating_point() else None)
    if token_keys:
        if starts is None or width is None:
            raise ValueError(f"per-token inputs {sorted(token_keys)} need the rows' layout (starts and width)")
        for key in sorted(token_keys):
            grid = torch.zeros((len(media), width), dtype=present[0].tokens[key].dtype)
            for row, (item, start) in enumerate(zip(media, starts)):
                if item is not None:
                    grid[row, start : start + len(item.tokens[key])] = item.tokens[key]
            out[key] = grid.to(device)
    return out


def multimodal_positions(model: Any, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                         inputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The 3-D rotary positions ([3, B, T]) of a model that places image tokens on a grid
    (Qwen2-VL and its successors: ``get_rope_index``), for rows padded as ``attention_mask_BT``
    says; None for a model with 1-D positions. Text tokens after the images continue from the
    largest position so far, so a row's next position is its last one + 1."""
    get_rope_index = _rope_index(model)
    if get_rope_index is None or not inputs:
        return None
    accepted = inspect.signature(get_rope_index).parameters
    given = {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT, **inputs}
    positions, _ = get_rope_index(**{k: v for k, v in given.items() if k in accepted})
    return positions  # type: ignore[no-any-return]


def uses_multimodal_positions(model: Any) -> bool:
    """Whether ``model`` computes 3-D rotary positions for its image tokens (`multimodal_positions`)."""
    return _rope_index(model) is not None


def _rope_index(model: Any) -> Any:
    """The model's ``get_rope_index`` (on its inner model, where Hugging Face puts it), or None."""
    return getattr(getattr(model, "model", model), "get_rope_index", None)


def image_token_ids(processor: Any | None) -> set[int]:
    """The token ids that stand for image content in a processor's prompts (never trained, never
    sampled); none without a processor (a text-only model)."""
    if processor is None:
        return set()
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
