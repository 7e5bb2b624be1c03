"""SFT and DPO: the assistant-only mask on a hand-built conversation, packing against separate
rows, the losses by hand, and end-to-end runs on the tiny model that must move the numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.algos.supervised import dpo_loss, sft_token_loss
from rlvr.config import load_config
from rlvr.data.chat import ChatDataError, Tokenized, pack, preference_pair, tokenize_chat
from rlvr.data.tasks import render_prompt
from rlvr.train.logprobs import packed_batch, packed_logprobs
from rlvr.train.offline import best_and_worst, dpo, sft
from rlvr.types import Completion, Group, Sample
from tests.test_train import overrides, read_metrics
from tests.tiny import EOS_ID, make_tiny_model

Tokenizer = PreTrainedTokenizerFast


def test_sft_mask_trains_exactly_the_assistant_content_and_its_end_token(tiny_tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6!"}]
    t = tokenize_chat(tiny_tokenizer, messages, eos_token_ids={EOS_ID})
    text = tiny_tokenizer.decode(list(t.ids))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n"
                    "<|im_start|>assistant\n6!<|im_end|>\n")
    trained = [tiny_tokenizer.decode([i]) for i, m in zip(t.ids, t.mask) if m]
    assert trained == ["4", "<|im_end|>", "6", "!", "<|im_end|>"]  # no header, no newline after the end token
    # the context of the first answer is tokenized exactly as the engine tokenizes a prompt
    first = t.mask.index(1)
    assert list(t.ids[:first]) == render_prompt(tiny_tokenizer, "2+2?", "Be brief.")
    last_only = tokenize_chat(tiny_tokenizer, messages, eos_token_ids={EOS_ID}, train_turns="last")
    assert [tiny_tokenizer.decode([i]) for i, m in zip(last_only.ids, last_only.mask) if m] == ["6", "!", "<|im_end|>"]


def test_bad_chat_rows_are_named(tiny_tokenizer: Tokenizer, tmp_path: Path) -> None:
    from rlvr.data.chat import messages_of, read_rows

    path = tmp_path / "chats.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"chats.jsonl:3: invalid JSON"):
        read_rows(path)
    with pytest.raises(ChatDataError, match=r"x.jsonl:7: message 0 must be"):
        messages_of({"messages": [{"role": "robot", "content": "hi"}]}, "x.jsonl:7")
    with pytest.raises(ChatDataError, match="needs \"messages\", or \"prompt\" and \"completion\""):
        messages_of({"text": "hi"}, "x.jsonl:1")
    with pytest.raises(ChatDataError, match="\"rejected\" must be a string"):
        preference_pair(tiny_tokenizer, {"prompt": "q", "chosen": "a"}, "p.jsonl:2", eos_token_ids={EOS_ID})


def test_packing_is_first_fit_longest_first() -> None:
    assert pack([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    assert pack([8, 1], 8) == [[0], [1]]
    with pytest.raises(ValueError, match="more than max_length"):
        pack([9], 8)


def test_a_packed_row_computes_what_separate_rows_do(tiny_model: LlamaForCausalLM) -> None:
    a = Tokenized(tuple(range(10, 17)), (0, 0, 0, 1, 1, 1, 1))
    b = Tokenized(tuple(range(40, 45)), (0, 0, 1, 1, 1))
    separate = packed_batch([[a], [b]], 0, torch.device("cpu"))
    packed = packed_batch([[a, b]], 0, torch.device("cpu"))
    lp_sep = packed_logprobs(tiny_model, separate, 64)
    lp_packed = packed_logprobs(tiny_model, packed, 64)
    assert int(packed["target"].sum()) == 7 and packed["position_ids"][0].tolist() == [*range(7), *range(5)]
    torch.testing.assert_close(lp_packed[0, :7], lp_sep[0, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_packed[0, 7:], lp_sep[1, :5], atol=1e-5, rtol=0)


def test_sft_token_loss_by_hand() -> None:
    logprobs = torch.tensor([[math.log(0.5), math.log(0.25), -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    plain = sft_token_loss(logprobs, mask)
    torch.testing.assert_close(plain, torch.tensor([[0.693147, 1.386294, 0.0]]))
    phi = sft_token_loss(logprobs, mask, weighting="chord_phi")  # p(1-p) = 0.25, 0.1875
    torch.testing.assert_close(phi, torch.tensor([[0.25 * 0.693147, 0.1875 * 1.386294, 0.0]]))
    phi.sum().backward()  # the weight is a constant: d/d logp = -w
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, -0.1875, 0.0]]))
    torch.testing.assert_close(sft_token_loss(logprobs, mask, weighting="sft_is"),
                               torch.tensor([[0.5 * 0.693147, 0.25 * 1.386294, 0.0]]))


def test_dpo_and_ipo_losses_by_hand() -> None:
    # h = (-1 - -1.5) - (-2 - -1.5) = 1
    c, r, rc, rr = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])
    loss, m = dpo_loss(c, r, rc, rr, beta=0.1)
    torch.testing.assert_close(loss, torch.tensor([math.log(1 + math.exp(-0.1))]))  # 0.644397
    assert m["preference_accuracy"] == 1 and m["margin"] == pytest.approx(0.1)
    assert m["chosen_reward"] == pytest.approx(0.05) and m["rejected_reward"] == pytest.approx(-0.05)
    smoothed, _ = dpo_loss(c, r, rc, rr, beta=0.1, label_smoothing=0.1)
    torch.testing.assert_close(smoothed, torch.tensor([0.9 * 0.644397 + 0.1 * 0.744397]))
    ipo, _ = dpo_loss(c, r, rc, rr, beta=0.1, kind="ipo")  # (1 - 1/0.2)^2
    torch.testing.assert_close(ipo, torch.tensor([16.0]))
    with pytest.raises(ValueError, match="unknown preference loss"):
        dpo_loss(c, r, rc, rr, kind="kto")


def test_online_pairs_are_best_over_worst_as_sampled() -> None:
    def sample(reward: float, tokens: tuple[int, ...]) -> Sample:
        return Sample((1, 2), Completion(tokens, (0.0,) * len(tokens), "stop", ""), reward, {}, 0)

    groups = [Group("q", [sample(0.0, (5,)), sample(1.0, (6, 7)), sample(0.5, (8,)), sample(1.0, (9,))]),
              Group("q", [sample(1.0, (5,)), sample(1.0, (6,))])]  # all equal: no pair
    pairs = best_and_worst(groups)
    assert len(pairs) == 1
    chosen, rejected = pairs[0]
    assert chosen == Tokenized((1, 2, 6, 7), (0, 0, 1, 1)) and rejected == Tokenized((1, 2, 5), (0, 0, 1))


def _chats(path: Path, n: int = 12) -> Path:
    rows = [{"prompt": f"What is {a} + {a}?", "completion": f"<answer>{2 * a}</answer>"} for a in range(n)]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@torch.no_grad()
def _mean_answer_logprob(model: LlamaForCausalLM, tokenizer: Tokenizer, path: Path) -> float:
    from rlvr.data.chat import messages_of, read_rows

    rows = [tokenize_chat(tokenizer, messages_of(r, "x"), eos_token_ids={EOS_ID}) for _, r in read_rows(path)]
    batch = packed_batch([[t] for t in rows], 0, torch.device("cpu"))
    lp = packed_logprobs(model, batch, 64)
    return float(lp.sum() / batch["target"].sum())


def sft_overrides(tiny_dir: Path, out: Path, name: str) -> list[str]:
    """test_train's small run, without the RL keys `rlvr sft` refuses to ignore."""
    return [o for o in overrides(tiny_dir, out, name) if not o.startswith("algo.")]


def test_sft_learns_the_answers_and_resumes(tiny_dir: Path, tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    data = _chats(tmp_path / "chats.jsonl")
    cfg = load_config(None, [*sft_overrides(tiny_dir, tmp_path, "sft"), f'sft.data="{data}"', "sft.epochs=6",
                             "sft.batch_size=2", "sft.max_length=160", "train.lr=3e-3"], command="sft")
    summary = sft(cfg, quiet=True)
    rows = read_metrics(tmp_path / "sft")
    assert summary["data"]["conversations"] == 13 and summary["data"]["rows"] < 13  # packed
    steps = math.ceil(summary["data"]["rows"] / 2) * 6
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert summary["loss_end"] < 0.7 * summary["loss_start"]
    assert "eval/accuracy" in summary["eval_before"] and "eval/accuracy" in summary["eval_after"]
    final = tmp_path / "sft" / "checkpoints" / f"step_{steps:06d}"
    before = _mean_answer_logprob(make_tiny_model(), tiny_tokenizer, data)
    after = _mean_answer_logprob(LlamaForCausalLM.from_pretrained(final), tiny_tokenizer, data)
    assert after > before + 0.5  # the answers became likelier under the saved model
    # resume: one more epoch continues from the final checkpoint, and the log stays one row per step
    sft(resume=tmp_path / "sft", overrides=("sft.epochs=7",), quiet=True)
    rows = read_metrics(tmp_path / "sft")
    assert [r["step"] for r in rows] == list(range(1, steps // 6 * 7 + 1))


def test_offline_dpo_prefers_the_chosen_answers(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Say {w}", "chosen": w, "rejected": w[::-1] + "??", "score_chosen": 1, "score_rejected": s}
            for w, s in [("apple", 0), ("pear", 0), ("plum", 0.9), ("fig", 0), ("kiwi", 0.8), ("lime", 0)]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = [*overrides(tiny_dir, tmp_path, "dpo"), f'dpo.data="{path}"', "dpo.epochs=8", "dpo.batch_size=3",
            "train.lr=3e-3", "dpo.beta=0.5"]
    summary = dpo(load_config(None, base, command="dpo"), quiet=True)
    rows_ = read_metrics(tmp_path / "dpo")
    assert len(rows_) == 16
    assert rows_[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at the start
    assert summary["loss_end"] < 0.5 * summary["loss_start"]
    assert rows_[-1]["preference_accuracy"] == 1 and rows_[-1]["margin"] > 0
    # MPO's stage 1: only the easy pairs (score gap >= 0.5)
    dpo(load_config(None, [*overrides(tiny_dir, tmp_path, "easy"), f'dpo.data="{path}"', "dpo.min_gap=0.5",
                           "dpo.batch_size=8"], command="dpo"), quiet=True)
    assert json.loads((tmp_path / "easy" / "summary.json").read_text())["data"]["pairs"] == 4
    assert read_metrics(tmp_path / "easy")[0]["pairs"] == 4


def test_a_pair_with_no_answer_token_within_max_length_is_dropped(tiny_dir: Path, tmp_path: Path) -> None:
    """A prompt that fills dpo.max_length leaves both answers empty: kept, the pair scored log 2
    and a wrong preference whatever the policy did (TRL drops such rows too)."""
    from rlvr.train.offline import preference_data
    from rlvr.models import load_tokenizer

    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Say yes", "chosen": "yes", "rejected": "no"},
            {"prompt": "Say yes " * 20, "chosen": "yes", "rejected": "no"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "d"), f'dpo.data="{path}"', "dpo.max_length=48"],
                      command="dpo")
    pairs, stats = preference_data(cfg, load_tokenizer(str(tiny_dir)))
    assert len(pairs) == 1 and stats["dropped"] == 1 and stats["truncated"] == 1
    assert all(p.chosen.trained and p.rejected.trained for p in pairs)


def test_online_dpo_trains_on_its_own_best_and_worst(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "online", train__steps=2), "dpo.online=true",
                             "train.lr=3e-3"], command="dpo")
    dpo(cfg, quiet=True)
    rows = read_metrics(tmp_path / "online")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["pairs"] > 0 and rows[0]["grad_norm"] > 0 and "reward" in rows[0]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy starts as the reference
    samples = (tmp_path / "online" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 2 * 4 * 4


def test_sft_on_the_tasks_own_prompts_never_uses_held_out_ones(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.train.data import load_examples
    from rlvr.train.offline import _conversations

    cfg = load_config(None, [*sft_overrides(tiny_dir, tmp_path, "task-sft"), "sft.task_examples=6",
                             'sft.answer_template="{expression} = {answer}"'], command="sft")
    convs = list(_conversations(cfg))
    train_examples, held = load_examples(cfg)
    assert [m[0]["content"] for _, m in convs] == [ex.prompt for ex in train_examples[:6]]
    assert not {m[0]["content"] for _, m in convs} & {ex.prompt for ex in held}
    first = train_examples[0]
    assert convs[0][1][1]["content"] == f"{first.fields['entry']['metadata']['expression']} = {first.answer}"
    summary = sft(cfg, quiet=True)
    assert summary["data"]["conversations"] == 6 and summary["loss_end"] > 0
    with pytest.raises(ValueError, match="uses 'reasoning', which example"):
        list(_conversations(load_config(None, [*sft_overrides(tiny_dir, tmp_path, "z"), "sft.task_examples=2",
                                               'sft.answer_template="{reasoning}"'], command="sft")))


def test_sft_and_dpo_say_what_is_missing(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="set sft.data"):
        sft(load_config(None, sft_overrides(tiny_dir, tmp_path, "x"), command="sft"), quiet=True)
    with pytest.raises(ValueError, match="set dpo.data"):
        dpo(load_config(None, overrides(tiny_dir, tmp_path, "y"), command="dpo"), quiet=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.parametrize(("config", "run"), [("sft", "sft"), ("rlp", "train"), ("hard_sum_sft", "sft"),
                                           ("hard_sum", "train")])
def test_the_pipeline_configs_run_on_the_tiny_model(tiny_dir: Path, tmp_path: Path, config: str, run: str) -> None:
    """Each stage of the shipped pipelines trains a step (hard_sum: issue 53's recipe for a task
    the model starts too weak at for RL alone; its stage 2 reads stage 1's run, here the tiny model)."""
    from rlvr.train.loop import train

    root = Path(__file__).resolve().parents[1]
    per_run = ["sft.task_examples=4", "sft.epochs=1", "task.size=20"] if run == "sft" else ["algo.group_size=2"]
    if config == "rlp":
        per_run.append(f'task.path="{root / "configs/data/corpus.txt"}"')
    cfg = load_config(root / f"configs/{config}.toml", [
        f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "train.steps=1", "train.prompts_per_step=2",
        "sampling.max_new_tokens=8", "task.eval_size=2", *per_run], command=run)
    summary = (sft if run == "sft" else train)(cfg, quiet=True)
    row = read_metrics(tmp_path / cfg.name)[0]
    assert summary["steps"] == 1
    if config == "hard_sum":  # the untrained tiny model gets no 3-term sum right: no signal, and the row says why
        assert row["zero_std_fraction"] == 1.0 and row["unsolved_fraction"] == 1.0
    else:
        assert row["grad_norm"] > 0


def test_sft_trains_a_lora_adapter_and_saves_the_merged_model(tiny_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    cfg = load_config(None, [*sft_overrides(tiny_dir, tmp_path, "lora-sft"), "lora.rank=4", "sft.task_examples=4",
                             "sft.batch_size=2", "sft.pack=false", "sft.epochs=2", "train.lr=1e-2"], command="sft")
    summary = sft(cfg, quiet=True)
    final = tmp_path / "lora-sft" / "checkpoints" / "step_000004"
    assert summary["loss_end"] < summary["loss_start"]
    assert (final / "adapter").is_dir() and (final / "model.safetensors").is_file()
