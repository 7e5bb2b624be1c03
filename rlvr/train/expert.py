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
  accuracy is at most `relift_max_accuracy` waits in a buffer. Whenever `relift_batch` prompts
  are waiting, one SFT step on their demonstrations follows the RL update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from rlvr.algos.supervised import chord_mu
from rlvr.data.chat import tokenize_chat, with_system
from rlvr.data.tasks import Example, demonstration_text
from rlvr.rewards.combine import score_group
from rlvr.train.rollouts import is_correct
from rlvr.types import Completion, Group, Sample


def demonstration(run: Any, index: int, prompt_ids: tuple[int, ...]) -> Sample:
    """The expert sample for training prompt `index` (see module docstring)."""
    cfg = run.cfg
    example: Example = run.examples[index]
    text = demonstration_text(example, cfg.expert.template)
    messages = with_system([{"role": "user", "content": example.prompt}, {"role": "assistant", "content": text}],
                           cfg.task.system_prompt)
    t = tokenize_chat(run.tokenizer, messages, eos_token_ids=set(run.engine.eos_token_ids), train_turns="last")
    start = t.mask.index(1)
    if tuple(t.ids[:start]) != tuple(prompt_ids):
        raise ValueError(f"the demonstration of {example.id} does not follow the prompt the engine sees (a chat "
                         "template that renders the assistant header differently); expert demonstrations need it to")
    tokens = tuple(i for i, m in zip(t.ids[start:], t.mask[start:]) if m)
    completion = Completion(tokens, (0.0,) * len(tokens), "stop", text)
    ((reward, parts),) = score_group(run.rewards, example.prompt, [text], example.fields, cfg.on_reward_error)
    return Sample(tuple(prompt_ids), completion, reward, parts, index, off_policy=True)


def step_demonstrations(run: Any, groups: list[Group]) -> list[Sample]:
    """One demonstration per group, for the prompt it answers."""
    return [demonstration(run, g.samples[0].prompt_index, g.samples[0].prompt_ids) for g in groups]


def mix_in(run: Any, groups: list[Group]) -> list[Group]:
    """LUFFY: every group with its demonstration appended (and a metadata dict of its own, so the
    update's per-sample entries do not spill into the policy's own group)."""
    return [replace(g, samples=(*g.samples, d), metadata=dict(g.metadata))
            for g, d in zip(groups, step_demonstrations(run, groups))]


def own_share(own: list[Group], mixed: list[Group]) -> None:
    """LUFFY, after the update: each of the policy's own groups gets the per-sample entries
    (advantages, mask reasons) of its own samples, the first ones of its mixed group."""
    for o, m in zip(own, mixed):
        for key in ("advantages", "masked"):
            if key in m.metadata:
                o.metadata[key] = m.metadata[key][: len(o.samples)]


def chord_settings(run: Any, step: int) -> Any:
    """The update settings of a (1-based) step, with CHORD's μ for it."""
    e = run.cfg.expert
    mu = chord_mu(step - 1, mu_peak=e.mu_peak, mu_valley=e.mu_valley, warmup_steps=e.mu_warmup_steps,
                  decay_steps=e.mu_decay_steps or run.cfg.train.steps)
    return replace(run.settings, expert_coef=mu, expert_weighting=e.weighting)


@dataclass
class Relift:
    """ReLIFT's buffer of hard prompts (training-prompt indices, oldest first)."""

    pending: list[int] = field(default_factory=list)

    def add(self, groups: list[Group], max_accuracy: float, primary: str) -> None:
        for g in groups:
            own = [x for x in g.samples if not x.off_policy]
            accuracy = sum(is_correct(x, primary) for x in own) / len(own)
            index = g.samples[0].prompt_index
            if accuracy <= max_accuracy and index not in self.pending:
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
