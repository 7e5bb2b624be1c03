"""A generative verifier as a reward: a causal LM trained to judge a proposed answer ("correct"
or "incorrect", the critique task of rlvr.data.critique) scores each completion by the
probability it gives "correct" (GenRM: Zhang et al., "Generative Verifiers: Reward Modeling as
Next-Token Prediction", arXiv:2408.15240, which reads the probability of "Yes").

The judge is trained the way RM-R1 trains one (Chen et al., "RM-R1: Reward Modeling as
Reasoning", arXiv:2505.02387): fine-tuned on verdicts, then reinforced with the verifiable
reward of agreeing with the known label (the ``verdict`` reward); docs/rewards.md gives the
recipe. The judge reads exactly the prompt the critique task trained it on (`critique_prompt`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlvr.models import load_model, load_tokenizer, padded_rows, resolve_device, resolve_dtype
from rlvr.rewards.extract import extract_answer

CRITIQUE_INSTRUCTION = "Is the proposed answer correct? Reply with one word: correct or incorrect."
VERDICTS = ("correct", "incorrect")


def critique_prompt(problem: str, candidate: str, instruction: str = CRITIQUE_INSTRUCTION) -> str:
    """What a judge reads: the problem, the proposed answer, and the question it answers."""
    return f"Problem: {problem.strip()}\n\nProposed answer: {candidate}\n\n{instruction}".strip()


class VerdictJudge:
    """A causal LM that answers a critique prompt with a verdict, on ``device`` in ``dtype``
    ("auto": the policy's rules). ``p_correct`` reads, in one forward pass and no sampling, the
    first token of each verdict as the assistant's reply would begin it."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto") -> None:
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model)
        self.model = load_model(model, resolve_dtype(dtype, self.device), self.device).eval()
        self.verdict_ids = [self._first_reply_token(v) for v in VERDICTS]
        if self.verdict_ids[0] == self.verdict_ids[1]:
            raise ValueError(f"generative_verifier: {model!r}'s tokenizer begins \"correct\" and \"incorrect\" with the "
                             "same token, so one forward pass cannot tell them apart")

    def _ids(self, text: str, reply: str | None = None) -> list[int]:
        """The chat's tokens as rlvr renders a prompt (rlvr.data.render_prompt): the template's text,
        then tokenized; with a ``reply``, the assistant's turn after it."""
        turns = [{"role": "user", "content": text}]
        if reply is not None:
            turns.append({"role": "assistant", "content": reply})
        rendered = self.tokenizer.apply_chat_template(turns, add_generation_prompt=reply is None, tokenize=False)
        return [int(i) for i in self.tokenizer(rendered, add_special_tokens=False)["input_ids"]]

    def _first_reply_token(self, reply: str) -> int:
        prompt, full = self._ids("x"), self._ids("x", reply)
        if full[: len(prompt)] != prompt:
            raise ValueError("generative_verifier: the judge's chat template does not render a reply after its generation "
                             "prompt, so where a verdict begins is unknown")
        return int(full[len(prompt)])

    def p_correct(self, prompts: list[str], batch_size: int = 16) -> list[float]:
        """For each critique prompt, P("correct") / (P("correct") + P("incorrect")) at the reply's
        first token."""
        rows = [self._ids(p) for p in prompts]
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                ids, mask = padded_rows(rows[start : start + batch_size], self.tokenizer.pad_token_id, left=True)
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
                                    ).logits[:, -1, self.verdict_ids].float()
                out += logits.softmax(-1)[:, 0].tolist()
        return out


_JUDGES: dict[tuple[str, str, str], VerdictJudge] = {}
_LOCK = threading.Lock()


def _judge(model: str, device: str, dtype: str) -> VerdictJudge:
    with _LOCK:
        if (model, device, dtype) not in _JUDGES:
            _JUDGES[model, device, dtype] = VerdictJudge(model, device, dtype)
        return _JUDGES[model, device, dtype]


def generative_verifier_reward(
    prompt: str | list[str], completions: list[str], *, model: str | None = None, extract: str | None = None,
    instruction: str = CRITIQUE_INSTRUCTION, score: str = "probability", device: str = "auto", dtype: str = "auto",
    batch_size: int = 16, **_: Any,
) -> list[float]:
    """A trained judge's verdict on each completion's answer; ``prompt`` is one prompt for all,
    or one per completion.

    kwargs: ``model`` (the judge: a folder, a run's folder or a hub id); ``extract`` (how the
    answer is read from a completion, e.g. "tag_or_last_number"; default the whole completion);
    ``instruction`` (the critique question, as the judge was trained with); ``score``
    ("probability": P(correct) over the two verdicts; "verdict": 1 where that is at least one
    half, else 0); ``device`` and ``dtype`` ("auto": the policy's rules); ``batch_size``.
    A completion with no answer to judge scores 0. A group reward."""
    if not model:
        raise ValueError('generative_verifier needs kwargs = {model = "<the judge: a folder or hub id>"}')
    if score not in ("probability", "verdict"):
        raise ValueError(f"generative_verifier: score must be \"probability\" or \"verdict\", got {score!r}")
    prompts = [prompt] * len(completions) if isinstance(prompt, str) else prompt
    answers = [extract_answer(c, extract) if extract else c.strip() for c in completions]
    judged = [i for i, a in enumerate(answers) if a]
    probabilities = _judge(model, device, dtype).p_correct(
        [critique_prompt(prompts[i], str(answers[i]), instruction) for i in judged], batch_size)
    scores = [0.0] * len(completions)
    for i, p in zip(judged, probabilities):
        scores[i] = p if score == "probability" else float(p >= 0.5)
    return scores
