"""Expert demonstrations during RL: the SFT+RL hybrids CHORD, LUFFY and ReLIFT (`[expert]`).

A prompt's demonstration is its task example's reference answer written out by
`expert.template` (`rlvr.data.tasks.demonstration_text`). It is tokenized like an SFT
conversation: after the prompt the engine sees, ending with the end-of-turn token. It is scored
by the run's rewards like any sample.

- **chord** (Zhang et al., arXiv:2508.11408): every optimizer step's loss is
  (1 − μ_t)·L_RL + μ_t·L_SFT. L_SFT is the token mean of the weighted NLL of the step's
  demonstrations (φ = p(1 − p) by default), and μ_t follows `rlvr.algos.supervised.chord_mu`.
- **luffy** (Yan et al., arXiv:2504.14945): each group gets its prompt's demonstration as one
  more sample. The group's advantages are taken over the policy's samples and the demonstration
  together, and the demonstration is trained off-policy with the shaped weight of
  `rlvr.algos.losses.luffy_loss`.
- **relift** (Ma et al., "Learning What Reinforcement Learning Can't: Interleaved Online
  Fine-Tuning for Hardest Questions", arXiv:2506.07527): RL as usual. A prompt whose group
  accuracy is at most `max_accuracy` waits in a buffer. Whenever `batch` prompts are waiting,
  one SFT step on their demonstrations follows the RL update.
- **warm_start**: RL as usual until the groups show the task is too hard for the policy (by
  default: over the last 5 steps, at least 75% of the groups had no sample right), then, once,
  `epochs` passes of plain SFT over the first `examples` training prompts' demonstrations, and RL
  goes on from there. It is the two-stage recipe (`rlvr sft` on the reference answers, then
  `rlvr train` from it) that lifted the bundled model on 3-term chain_sum from 7.8% to 44-61%
  held-out (docs/LOG.md, sessions 27-28), in one run that spends the SFT only where RL has no
  signal. Its SFT steps advance the learning-rate schedule like ReLIFT's.

Each mode's own knobs are `expert.kwargs`, checked against its options below (OPTIONS).
"""

from __future__ import annotations

import logging
import random
import statistics
import string
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from rlvr.agents.openai_agent import SERVED_IN_PROCESS
from rlvr.agents.runner import FAILED
from rlvr.algos import aggregate_loss
from rlvr.options import EXPERT_OPTIONS as OPTIONS, ChordOptions, ReliftOptions, WarmStartOptions
from rlvr.algos.supervised import chord_mu, sft_token_loss
from rlvr.data.chat import tokenize_chat, with_system
from rlvr.data.tasks import NEXT_TURN, Example, demonstration_text
from rlvr.rewards.combine import score_group
from rlvr.train.batches import scored_batches
from rlvr.train.learner import Learner
from rlvr.train.methods.base import Method, SetupInfo, Plan
from rlvr.train.rollouts import judged_accuracy
from rlvr.train.settings import UpdateSettings
from rlvr.types import Completion, Group, Sample

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run

log = logging.getLogger(__name__)


def demonstration(run: Run, index: int, prompt_ids: tuple[int, ...]) -> Sample:
    """The expert sample for training prompt `index` (see module docstring)."""
    cfg = run.cfg
    if run.task.media is not None:
        raise ValueError("expert demonstrations (expert.mode) on prompts with images are not supported yet: "
                         "a demonstration is rendered as text (docs/vlm.md)")
    example: Example = run.task.examples[index]
    text = demonstration_text(example, cfg.expert.template)
    if NEXT_TURN in text:
        raise ValueError(f"{{next_turn}} in expert.template separates the turns of an episode (env.name); the "
                         f"demonstration of {example.id} is one reply")
    messages = with_system([{"role": "user", "content": example.prompt}, {"role": "assistant", "content": text}],
                           cfg.task.system_prompt)
    t = tokenize_chat(run.tokenizer, messages, eos_token_ids=set(run.engine.eos_token_ids), train_turns="last")
    start = t.mask.index(1)
    if tuple(t.ids[:start]) != tuple(prompt_ids):
        raise ValueError(f"the demonstration of {example.id} does not follow the prompt the engine sees (a chat "
                         "template that renders the assistant header differently); expert demonstrations need it to")
    tokens = tuple(i for i, m in zip(t.ids[start:], t.mask[start:]) if m)
    completion = Completion(tokens, (0.0,) * len(tokens), "stop", text)
    ((reward, parts),) = score_group(run.task.rewards, example.prompt, [text], example.fields, cfg.on_reward_error)
    return Sample(tuple(prompt_ids), completion, reward, parts, index, off_policy=True)


def step_demonstrations(run: Run, groups: list[Group]) -> list[Sample]:
    """One demonstration per group, for the prompt it answers."""
    return [demonstration(run, g.samples[0].prompt_index, g.samples[0].prompt_ids) for g in groups]


class Luffy(Method):
    """Every group the update trains on gets its prompt's demonstration, appended after the
    policy's own samples (so `UpdateResult.outcomes(plan.own)` gives the own groups theirs)."""

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        mixed = [replace(g, samples=(*g.samples, d))
                 for g, d in zip(plan.groups, step_demonstrations(run, plan.groups))]
        return replace(plan, groups=mixed)


@dataclass(frozen=True)
class Imitation:
    """CHORD's LossTerm: coef · (token mean of the weighted SFT loss over the demonstrations),
    added to every optimizer step's gradient; its NLL is logged as expert/nll."""

    demos: list[Sample]
    coef: float
    weighting: str

    def add(self, learner: Learner, s: UpdateSettings, pad_token_id: int, device: torch.device,
            sums: dict[str, float]) -> None:
        total = float(sum(x.completion.trainable() for x in self.demos))
        for _, batch, logprobs_BT in scored_batches(learner.model, self.demos, s, pad_token_id, device):
            mask_BT = batch["loss_mask"]
            sft_BT = sft_token_loss(logprobs_BT, mask_BT, weighting=self.weighting)
            (self.coef * aggregate_loss(sft_BT, mask_BT, mode="token-mean", total_tokens=total)).backward()
            sums["_expert_tokens"] += float(mask_BT.sum())
            sums["expert_nll"] += float(-(logprobs_BT.detach() * mask_BT).sum())

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        """The demonstrations' mean negative log-likelihood, as expert/nll."""
        tokens = sums.pop("_expert_tokens", 0.0)
        return {"expert/nll": sums.pop("expert_nll") / tokens} if tokens else {}


def imitation_step(learner: Learner, demos: list[Sample], s: UpdateSettings, *, pad_token_id: int) -> dict[str, float]:
    """One optimizer step of plain SFT (token-mean NLL) on `demos`: ReLIFT's interleaved fine-tuning."""
    sums: dict[str, float] = defaultdict(float)
    learner.model.train()
    Imitation(demos, 1.0, "none").add(learner, s, pad_token_id, next(learner.model.parameters()).device, sums)
    grad_norm = learner.step()
    return {"expert/sft_nll": sums["expert_nll"] / sums["_expert_tokens"], "expert/sft_grad_norm": grad_norm}


class Chord(Method):
    """Each step's update weighs its RL loss by 1 − μ and adds μ·SFT on the step's demonstrations."""

    def __init__(self, options: ChordOptions) -> None:
        self.options = options

    def mu(self, run: Run, step: int) -> float:
        o = self.options
        return chord_mu(step - 1, mu_peak=o.mu_peak, mu_valley=o.mu_valley, warmup_steps=o.mu_warmup_steps,
                        decay_steps=o.mu_decay_steps or run.cfg.train.steps)

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        mu = self.mu(run, step)
        demos = step_demonstrations(run, plan.groups)
        terms = (*plan.extras.terms, Imitation(demos, mu, self.options.weighting)) if mu else plan.extras.terms
        return replace(plan, settings=replace(plan.settings, loss=replace(plan.settings.loss, policy_weight=1 - mu)),
                       extras=replace(plan.extras, terms=terms))

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        return {"expert/mu": self.mu(run, step)}


@dataclass
class HardPrompts:
    """ReLIFT's buffer of hard prompts (training-prompt indices, oldest first)."""

    pending: list[int] = field(default_factory=list)

    def add(self, groups: list[Group], max_accuracy: float, primary: str) -> None:
        for g in groups:
            # over the samples with a verdict: a prompt whose sandbox was down is not shown to be hard
            accuracy = judged_accuracy([x for x in g.samples if not x.off_policy], primary)
            index = g.samples[0].prompt_index
            if accuracy is not None and accuracy <= max_accuracy and index not in self.pending:
                self.pending.append(index)

    def take(self, n: int) -> list[int] | None:
        """The n oldest hard prompts, if n are waiting."""
        if len(self.pending) < n:
            return None
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = [int(i) for i in state["pending"]]


class Relift(Method):
    """After each RL update: hard prompts join the buffer, and a full batch of them gets an SFT step."""

    state_key = "relift"

    def __init__(self, options: ReliftOptions) -> None:
        self.options = options
        self.buffer = HardPrompts()

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        self.buffer.add(plan.own, self.options.max_accuracy, run.task.rewards[0].name)
        hard = self.buffer.take(self.options.batch)
        out: dict[str, float] = {}
        if hard is not None:
            demos = [demonstration(run, i, tuple(run.task.prompt_ids[i])) for i in hard]
            out |= imitation_step(run.learner, demos, plan.settings, pad_token_id=run.engine.pad_token_id)
        return out | {"expert/relift_pending": float(len(self.buffer.pending)), "expert/relift_sft": float(hard is not None)}

    def state_dict(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)


class WarmStart(Method):
    """Once the window's groups are mostly unsolved (or after the first step): SFT epochs on the
    training prompts' demonstrations, then RL as before (see the module docstring)."""

    state_key = "warm_start"

    def __init__(self, options: WarmStartOptions, seed: int) -> None:
        self.options, self.seed = options, seed
        self.unsolved: deque[float] = deque(maxlen=options.window)
        self.done_at: int | None = None

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        if self.done_at is not None:
            return {}
        o = self.options
        # the policy's own groups carry their judged accuracy from collection (`with_accuracy`);
        # a group without a verdict shows nothing
        judged = [g.accuracy for g in plan.own if g.accuracy is not None]
        if judged:
            self.unsolved.append(statistics.fmean(a == 0 for a in judged))
        if o.when == "unsolved":
            if len(self.unsolved) < o.window or statistics.fmean(self.unsolved) < o.threshold:
                return {"expert/warm_start_unsolved": statistics.fmean(self.unsolved)} if self.unsolved else {}
            cause = (f"over the last {o.window} steps {statistics.fmean(self.unsolved):.0%} of the groups had no "
                     "sample right")
        else:
            cause = "expert.kwargs.when = \"start\""
        return self.warm_start(run, plan, step, cause)

    def warm_start(self, run: Run, plan: Plan, step: int, cause: str) -> dict[str, float]:
        o = self.options
        indices = list(range(min(o.examples, len(run.task.examples))))
        steps = o.epochs * -(-len(indices) // o.batch)
        log.warning("expert warm start at step %d: %s; fine-tuning on %d demonstrations (expert.template), "
                    "%d epochs, %d SFT steps, then RL goes on", step, cause, len(indices), o.epochs, steps)
        demos = warm_start_demonstrations(run, indices)
        solved = statistics.fmean(d.reward for d in demos.values())
        log.warning("expert warm start: the demonstrations' mean reward is %.3f", solved)
        rng, t0, nll = random.Random(self.seed), time.perf_counter(), []
        for epoch in range(o.epochs):
            order = rng.sample(indices, len(indices))  # a fresh order each epoch, the same on a rerun
            epoch_nll = [imitation_step(run.learner, [demos[i] for i in order[first:first + o.batch]], plan.settings,
                                        pad_token_id=run.engine.pad_token_id)["expert/sft_nll"]
                         for first in range(0, len(order), o.batch)]
            nll += epoch_nll
            log.warning("expert warm start: epoch %d of %d done after %.0f s, demonstration NLL %.3f", epoch + 1,
                        o.epochs, time.perf_counter() - t0, statistics.fmean(epoch_nll))
        self.done_at = step
        quarter = max(1, len(nll) // 4)
        return {"expert/warm_start_steps": float(len(nll)), "expert/warm_start_seconds": time.perf_counter() - t0,
                "expert/warm_start_demo_reward": solved,
                "expert/warm_start_nll_first": statistics.fmean(nll[:quarter]),
                "expert/warm_start_nll_last": statistics.fmean(nll[-quarter:])}

    def save_after(self, step: int) -> bool:
        return self.done_at == step  # the fine-tuning is kept at once, not at the next checkpoint_every

    def state_dict(self) -> dict[str, Any]:
        return {"done_at": self.done_at, "unsolved": list(self.unsolved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done_at = state["done_at"]
        self.unsolved.clear()
        self.unsolved.extend(float(u) for u in state["unsolved"])


def warm_start_demonstrations(run: Run, indices: list[int]) -> dict[int, Sample]:
    """Each training prompt's demonstration: after its prompt, or with env.name played through its
    environment (`played_demonstration`)."""
    if run.cfg.env.name is None:
        return {i: demonstration(run, i, tuple(run.task.prompt_ids[i])) for i in indices}
    return {i: played_demonstration(run, i) for i in indices}


class _Script:
    """An engine that answers each turn with the next of a demonstration's turns (one episode)."""

    def __init__(self, turns: list[str], tokenizer: Any, eos_token_ids: list[int], pad_token_id: int) -> None:
        self.turns, self.tokenizer = list(turns), tokenizer
        self.eos_token_ids, self.pad_token_id, self.version = list(eos_token_ids), pad_token_id, None
        self.ran_out = False

    def generate(self, prompts: list[list[int]], params: Any, progress: Any = None, *,
                 seeds: Any = None) -> list[list[Completion]]:
        out = []
        for _ in prompts:
            self.ran_out |= not self.turns
            text = self.turns.pop(0) if self.turns else ""
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False) + self.eos_token_ids[:1])
            out.append([Completion(ids, (0.0,) * len(ids), "stop", text) for _ in range(params.n)])
        return out


def played_demonstration(run: Run, index: int) -> Sample:
    """A demonstration of a whole episode: the template's turns (split at `{next_turn}`) played as
    the policy's actions through the example's environment, by the run's own episode runner, so
    the environment's observations come between them, masked, exactly as the policy will see
    them (an MCP call, its result, the answer; a command, its output, "done")."""
    example: Example = run.task.examples[index]
    turns = demonstration_text(example, run.cfg.expert.template).split(NEXT_TURN)
    script = _Script(turns, run.tokenizer, list(run.engine.eos_token_ids), run.engine.pad_token_id)
    assert run.task.episodes is not None
    (group,) = run.task.episodes(script, run.task.examples, [index], 1)  # type: ignore[arg-type]
    (sample,) = group.samples
    ending = group.metadata["endings"][0]
    where = f"the demonstration of {example.id} (expert.template, turns split at {{next_turn}})"
    if script.ran_out:
        raise ValueError(f"{where} ran out of turns before its episode ended ({len(turns)} turns written); write "
                         "the rest, separated by {next_turn}")
    if script.turns:
        raise ValueError(f"{where} has {len(script.turns)} turns left after its episode ended ({ending})")
    if ending in FAILED:
        raise ValueError(f"{where} failed in its environment ({ending}): {group.metadata.get('texts', [''])[0]!r:.300}")
    if ending != "done":  # cut off by a limit: not a demonstration of finishing
        raise ValueError(f"{where} did not finish its episode: it ended {ending!r} (env.max_turns and the token limits "
                         "hold for demonstrations too)")
    return replace(sample, off_policy=True)


def check(cfg: RunConfig) -> None:
    """The expert hybrids (LUFFY, CHORD, ReLIFT) and what their demonstrations need (run when a
    run opens, before the model loads)."""
    mode = cfg.expert.mode
    if (mode == "luffy") != (cfg.algo.loss == "luffy"):
        raise ValueError("expert.mode = \"luffy\" and algo.loss = \"luffy\" go together: the loss trains the "
                         "demonstrations mixed into the groups, and without them it is PPO's")
    if mode in ("relift", "warm_start") and cfg.dist.learners > 1:
        raise ValueError(f"expert.mode = \"{mode}\" runs its SFT steps in one learner; unset dist.learners")
    if mode != "none" and cfg.sampler.templates:
        raise ValueError("expert demonstrations follow the task's own prompt; they do not combine with "
                         "sampler.templates")
    if mode not in ("none", "warm_start") and cfg.env.name is not None:
        raise ValueError(f"expert.mode = {mode!r} trains single-turn demonstrations; it does not "
                         "combine with multi-turn episodes (env.name); \"warm_start\" does (its demonstrations "
                         "are whole episodes, played through the environment)")
    if mode == "warm_start" and cfg.env.name in SERVED_IN_PROCESS:
        raise ValueError(f"expert.mode = \"warm_start\" plays its demonstrations through rlvr's episode runner; "
                         f"env.name = {cfg.env.name!r} runs an agent that writes its own prompts")


def build_luffy(run: Run, info: SetupInfo) -> Method | None:
    return Luffy() if run.cfg.expert.mode == "luffy" else None


def build_chord(run: Run, info: SetupInfo) -> Method | None:
    e = run.cfg.expert
    return Chord(e.options()) if e.mode == "chord" else None


def build_relift(run: Run, info: SetupInfo) -> Method | None:
    e = run.cfg.expert
    return Relift(e.options()) if e.mode == "relift" else None


def build_warm_start(run: Run, info: SetupInfo) -> Method | None:
    e = run.cfg.expert
    if e.mode != "warm_start":
        return None
    options: WarmStartOptions = e.options()
    examples = run.task.examples[: options.examples]
    uses_answer = any(name == "answer" for _, name, _, _ in string.Formatter().parse(e.template))
    missing = [ex.id for ex in examples if uses_answer and ex.answer is None]
    if missing:
        raise ValueError(f"expert.mode = \"warm_start\" trains on the training prompts' reference answers, and "
                         f"{len(missing)} of the first {options.examples} have none (e.g. {missing[0]})")
    for ex in examples:  # every demonstration can be written (the error names what a field lacks)
        demonstration_text(ex, e.template)
    return WarmStart(options, run.cfg.seed)
