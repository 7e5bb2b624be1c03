"""A sequence-classification reward model as a reward: loaded once per process on the device and in
the dtype the policy's "auto" picks, fed length-sorted batches of every completion of a step at
once (`RewardFn.many`, the seam `score_groups` calls), optionally on a Ray actor of its own
(``ray = true``: a GPU, or CPU cores, that the learner does not share).

What the model reads is `rm_text`, exactly what `rlvr rm train` trained it on."""

from __future__ import annotations

import threading
from typing import Any

import torch

from rlvr.errors import InfrastructureError
from rlvr.log.tracking import import_extra
from rlvr.models import resolve_device, resolve_dtype, resolve_model_path


def rm_text(tokenizer: Any, context: list[dict[str, str]], completion: str) -> str:
    """What a reward model reads: the conversation ``context`` and the assistant's ``completion``,
    rendered with the tokenizer's chat template when it has one, else the turns' texts joined by
    blank lines. `rlvr rm` trains on exactly this, and the ``reward_model`` reward scores it."""
    turns = [*context, {"role": "assistant", "content": completion}]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(turns, tokenize=False))
    return "\n\n".join(t["content"] for t in turns)


def rm_batch(tokenizer: Any, texts: list[str], max_length: int) -> Any:
    """``texts`` as one padded batch, each cut to its last ``max_length`` tokens: a sequence
    classifier reads its score at the last token, so a long text loses its beginning, never the
    end of the answer."""
    tokenizer.truncation_side = "left"  # the same for every caller: no other setting is ever wanted here
    return tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length)


class RewardModelScorer:
    """One reward model, loaded on ``device`` in ``dtype`` ("auto": the policy's rules,
    `resolve_device` and `resolve_dtype`: a CUDA GPU where torch sees one, and bf16 where that
    device computes it fast), scoring (prompt, completion) pairs. The pairs are sorted by length
    and cut into batches of ``batch_size``, so a batch pads little; a model with one output gives
    its logit, with several the probability of class ``label`` (default: the last).
    The same class runs in this process or as a Ray actor (`RayScorer`)."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", max_length: int = 2048,
                 batch_size: int = 32, label: int | None = None) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_length, self.batch_size, self.label = max_length, batch_size, label
        model = resolve_model_path(model)  # a run's folder, or a "builtin:" model with a new head (`rlvr bench`)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(model, dtype=self.dtype).to(self.device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Each (prompt, completion)'s score, in the order given."""
        texts = [rm_text(self.tokenizer, [{"role": "user", "content": p}], c) for p, c in pairs]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # characters: close enough to tokens to batch by
        scores = [0.0] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                batch = rm_batch(self.tokenizer, [texts[i] for i in rows], self.max_length).to(self.device)
                logits = self.model(**batch).logits.float()
                if logits.shape[-1] == 1:
                    values = logits[:, 0]
                else:
                    values = logits.softmax(-1)[:, -1 if self.label is None else self.label]
                for i, v in zip(rows, values.tolist()):
                    scores[i] = v
        return scores

    def where(self) -> str:
        """The device and dtype it scores on, for a log line or a benchmark."""
        return f"{self.device} {str(self.dtype).removeprefix('torch.')}"


_SCORERS: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()
RAY_HINT = "pip install 'rlvr[ray]'"


def scorer(settings: dict[str, Any], ray: bool, ray_gpus: float, ray_cpus: float,
           ray_timeout_s: float) -> "RewardModelScorer | RayScorer":
    """The process's scorer for these settings (`RewardModelScorer`'s arguments), made on first use
    and kept: a model loads once."""
    key = (tuple(sorted(settings.items())), ray, ray_gpus, ray_cpus, ray_timeout_s)
    with _LOCK:
        if key not in _SCORERS:
            _SCORERS[key] = (RayScorer(settings, gpus=ray_gpus, cpus=ray_cpus, timeout_s=ray_timeout_s) if ray
                             else RewardModelScorer(**settings))
        return _SCORERS[key]


class RayScorer:
    """`RewardModelScorer` in a Ray actor that reserves ``gpus`` and ``cpus`` (Ray's own, started
    here if this process has none: in a `dist` run it is the run's cluster, and $RAY_ADDRESS
    joins one). A call the actor does not answer within ``timeout_s``, or an actor that died, is
    an InfrastructureError: the samples are left out of the update, never scored 0; the next call
    starts a new actor."""

    def __init__(self, settings: dict[str, Any], *, gpus: float, cpus: float, timeout_s: float) -> None:
        self.ray = import_extra("ray", f"reward_model with ray = true needs Ray: {RAY_HINT}")
        if not self.ray.is_initialized():
            self.ray.init(include_dashboard=False, log_to_driver=False)
        self.settings, self.timeout_s = settings, timeout_s
        self.options = {"num_gpus": gpus, "num_cpus": cpus}
        self.actor: Any = None

    def _actor(self) -> Any:
        if self.actor is None:
            self.actor = self.ray.remote(RewardModelScorer).options(**self.options).remote(**self.settings)
        return self.actor

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        actor = self._actor()
        try:
            return list(self.ray.get(actor.score.remote(pairs), timeout=self.timeout_s))
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as err:
            self.ray.kill(actor)
            self.actor = None
            raise InfrastructureError(f"the reward model's Ray actor gave no scores ({type(err).__name__}: "
                                      f"{str(err)[:300]}); a new one starts on the next call") from err

    def where(self) -> str:
        return str(self.ray.get(self._actor().where.remote(), timeout=self.timeout_s))


def reward_model_reward(
    prompt: str | list[str], completions: list[str], *, model: str | None = None, device: str = "auto",
    dtype: str = "auto", max_length: int = 2048, batch_size: int = 32, label: int | None = None, ray: bool = False,
    ray_gpus: float = 0.0, ray_cpus: float = 1.0, ray_timeout_s: float = 600.0, **_: Any,
) -> list[float]:
    """Scores of a sequence-classification reward model for each (prompt, completion); ``prompt``
    is one prompt for all, or one per completion.

    kwargs: ``model`` (a local path, e.g. `rlvr rm train`'s output, or a hub id); ``device`` and
    ``dtype`` ("auto": as the policy's, a CUDA GPU where torch sees one and bf16 where the device
    computes it fast; or e.g. "cpu", "cuda:1", "fp32", "bf16"); ``max_length`` (a longer text
    loses its beginning); ``batch_size``; ``label`` (the class whose probability a model with
    several outputs gives; default the last); ``ray`` (score on a Ray actor of its own that
    reserves ``ray_gpus`` and ``ray_cpus``, each call answered within ``ray_timeout_s``).

    A group reward: called once per prompt; in training `score_groups` calls it once a step with
    every completion, each with its prompt (`RewardFn.many`), so that batches are full."""
    if not model:
        raise ValueError('reward_model needs kwargs = {model = "<path or hub id of a sequence-classification model>"}')
    prompts = [prompt] * len(completions) if isinstance(prompt, str) else prompt
    settings = {"model": model, "device": device, "dtype": dtype, "max_length": max_length, "batch_size": batch_size,
                "label": label}
    return scorer(settings, ray, ray_gpus, ray_cpus, ray_timeout_s).score(list(zip(prompts, completions, strict=True)))
