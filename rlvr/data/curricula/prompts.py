"""Curricula over single prompts: Kimi's prioritised sampling, easy-to-hard schedules, and the
success-rate targeting of MoPPS, DOTS and PCL."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlvr.data.curricula.base import (
    SamplerContext,
    _accuracy,
    _allowed,
    _closest,
    _draw,
    _prompt,
    _rng,
    _softmax,
    text_features,
)
from rlvr.types import Group


class PrioritizedSampler:
    """Kimi k1.5's prioritized sampling (Kimi Team, "Kimi k1.5: Scaling Reinforcement Learning
    with LLMs", arXiv:2501.12599, §2.3.4): track each prompt's success rate s_i and draw prompts
    with probability P(i) ∝ 1 − s_i, so that the ones the policy fails on come back more often.

    Choices (the report gives only the proportionality):
      s_i ← decay·s_i + (1 − decay)·accuracy on each observation (decay = 0: the latest accuracy,
      i.e. what the current policy does); an unseen prompt has s_i = prior (0.5);
      weights are max(1 − s_i, floor) so that a solved prompt (s_i = 1) keeps a small chance of
      being re-checked (floor = 0.01);
      a batch is drawn without replacement with these probabilities (numpy's weighted sampling without replacement)."""

    def __init__(self, ctx: SamplerContext, *, prior: float = 0.5, decay: float = 0.0, floor: float = 0.01) -> None:
        if not (0 <= prior <= 1 and 0 <= decay < 1 and 0 < floor <= 1):
            raise ValueError(f"sampler 'prioritized': need 0 ≤ prior ≤ 1, 0 ≤ decay < 1, 0 < floor ≤ 1 "
                             f"(got prior={prior}, decay={decay}, floor={floor})")
        self.num_prompts, self.seed, self.decay, self.floor = len(ctx.texts), ctx.seed, decay, floor
        self.success_P = np.full(self.num_prompts, float(prior))
        self.seen_P = np.zeros(self.num_prompts, dtype=bool)
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last: list[int] = []

    def probabilities(self) -> np.ndarray:
        w_P = np.maximum(1.0 - self.success_P, self.floor)
        return w_P / w_P.sum()

    def next_batch(self, n: int) -> list[int]:
        pool = _allowed(self.num_prompts, self.pending, n)
        p = self.probabilities()[pool]
        out = _draw(_rng(self.seed, "prioritized", self.calls), pool, n, p / p.sum())
        self.calls, self.drawn, self.pending, self.last = self.calls + 1, self.drawn + n, self.pending + out, out
        return out

    def observe(self, groups: list[Group]) -> None:
        for g in groups:
            if g.samples:
                i = _prompt(g)
                self.success_P[i] = self.decay * self.success_P[i] + (1 - self.decay) * _accuracy(g)
                self.seen_P[i] = True
        self.pending = []

    def metrics(self) -> dict[str, float]:
        chosen = float(self.success_P[self.last].mean()) if self.last else 0.0
        return {"success_chosen": chosen, "success_mean": float(self.success_P.mean()),
                "seen": float(self.seen_P.mean())}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "success": self.success_P.tolist(), "seen": self.seen_P.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.success_P = np.array(state["success"], dtype=np.float64)
        self.seen_P = np.array(state["seen"], dtype=bool)


class ScheduleSampler:
    """A fixed easy→hard curriculum over a known difficulty (the easy→hard curriculum sampling of
    Kimi k1.5, arXiv:2501.12599, §2.3.4, and the staged schedules of many papers).

    Prompts are ranked by ctx.difficulty (ascending; ties by index). Call k of next_batch
    (k = 0, 1, ...) is in stage s = the number of boundaries ≤ k, and draws uniformly without
    replacement from the easiest ceil((s + 1)/stages · P) prompts (P = number of prompts), so the
    last stage draws from all of them. boundaries: `stages − 1` increasing call numbers; or
    total_steps, which gives boundaries[s − 1] = floor(s · total_steps / stages). E.g. stages=3,
    total_steps=30: calls 0–9 from the easiest third, 10–19 from the easiest two thirds, 20– from
    all. A call counts as one step (a strategy that asks twice per step moves faster: say so in
    total_steps)."""

    def __init__(self, ctx: SamplerContext, *, stages: int = 3, total_steps: int | None = None,
                 boundaries: list[int] | None = None) -> None:
        if ctx.difficulty is None:
            raise ValueError("sampler 'schedule' needs a difficulty per prompt (sampler.difficulty_field)")
        if stages < 1:
            raise ValueError(f"sampler 'schedule': stages must be ≥ 1 (got {stages})")
        if (total_steps is None) == (boundaries is None):
            raise ValueError("sampler 'schedule': give exactly one of total_steps and boundaries")
        if boundaries is None:
            assert total_steps is not None
            boundaries = [s * total_steps // stages for s in range(1, stages)]
        if len(boundaries) != stages - 1 or any(b >= c for b, c in zip(boundaries, boundaries[1:])):
            raise ValueError(f"sampler 'schedule': boundaries must be {stages - 1} increasing step numbers "
                             f"(got {boundaries})")
        self.boundaries, self.stages = [int(b) for b in boundaries], stages
        self.ranked = np.argsort(np.asarray(ctx.difficulty, dtype=np.float64), kind="stable")
        self.difficulty = np.asarray(ctx.difficulty, dtype=np.float64)
        self.num_prompts, self.seed, self.calls, self.drawn = len(ctx.texts), ctx.seed, 0, 0
        self.last: list[int] = []

    def stage(self, call: int) -> int:
        return sum(b <= call for b in self.boundaries)

    def pool(self, call: int) -> np.ndarray:
        return self.ranked[:math.ceil((self.stage(call) + 1) / self.stages * self.num_prompts)]

    def next_batch(self, n: int) -> list[int]:
        out = _draw(_rng(self.seed, "schedule", self.calls), self.pool(self.calls), n)
        self.calls, self.drawn, self.last = self.calls + 1, self.drawn + n, out
        return out

    def observe(self, groups: list[Group]) -> None:
        """A fixed schedule ignores outcomes."""

    def metrics(self) -> dict[str, float]:
        chosen = float(self.difficulty[self.last].mean()) if self.last else 0.0
        return {"stage": float(self.stage(max(self.calls - 1, 0))), "difficulty_chosen": chosen,
                "pool_fraction": len(self.pool(self.calls)) / self.num_prompts}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])


class MoPPSSampler:
    """Model Predictive Prompt Selection (Qu et al., "Can Prompt Difficulty be Online Predicted
    for Accelerating RL Finetuning of Reasoning Models?", arXiv:2507.04632).

    Each prompt's success rate γ has a Beta(α, β) posterior, starting at the prior (α0, β0).
    Observing a group of k samples with s = accuracy·k successes discounts the old evidence
    toward the prior (λ = decay):
        α ← λ·α + (1 − λ)·α0 + s,        β ← λ·β + (1 − λ)·β0 + (k − s).
    Prompts not observed keep their posterior. Selection: draw a candidate pool of
    candidates_factor·n prompts uniformly (without replacement, all prompts if that is more),
    Thompson-sample γ̂ ~ Beta(α, β) for each and keep the n with the smallest (γ̂ − γ*)²
    (γ* = target).

    Defaults: target 0.5, λ = 0.5, α0 = β0 = 1, candidates_factor = 8 (as in the authors' verl
    recipe scripts: bandit_decay_ratio=0.5, ts_ratio=8; the uniform Beta(1, 1) prior is our
    choice)."""

    def __init__(self, ctx: SamplerContext, *, target: float = 0.5, decay: float = 0.5, prior_alpha: float = 1.0,
                 prior_beta: float = 1.0, candidates_factor: float = 8.0) -> None:
        if not (0 <= decay <= 1 and prior_alpha > 0 and prior_beta > 0 and candidates_factor >= 1):
            raise ValueError("sampler 'mopps': need 0 ≤ decay ≤ 1, prior_alpha > 0, prior_beta > 0, "
                             "candidates_factor ≥ 1")
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.target, self.decay, self.candidates_factor = target, decay, candidates_factor
        self.prior_alpha, self.prior_beta = prior_alpha, prior_beta
        self.alpha_P = np.full(self.num_prompts, float(prior_alpha))
        self.beta_P = np.full(self.num_prompts, float(prior_beta))
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last: list[int] = []
        self.last_sampled = 0.0

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "mopps", self.calls)
        allowed = _allowed(self.num_prompts, self.pending, n)
        pool = np.array(_draw(rng, allowed, min(len(allowed), math.ceil(self.candidates_factor * n))))
        gamma = rng.beta(self.alpha_P[pool], self.beta_P[pool])
        out = _closest(rng, pool, gamma, self.target, n)
        sampled = dict(zip(pool.tolist(), gamma.tolist()))
        self.last_sampled = float(np.mean([sampled[i] for i in out]))
        self.calls, self.drawn, self.pending, self.last = self.calls + 1, self.drawn + n, self.pending + out, out
        return out

    def observe(self, groups: list[Group]) -> None:
        lam = self.decay
        for g in groups:
            if not g.samples:
                continue
            i, k = _prompt(g), len(g.samples)
            s = _accuracy(g) * k
            self.alpha_P[i] = lam * self.alpha_P[i] + (1 - lam) * self.prior_alpha + s
            self.beta_P[i] = lam * self.beta_P[i] + (1 - lam) * self.prior_beta + (k - s)
        self.pending = []

    def posterior_mean(self) -> np.ndarray:
        return self.alpha_P / (self.alpha_P + self.beta_P)

    def metrics(self) -> dict[str, float]:
        if not self.last:
            return {}
        return {"predicted_success": float(self.posterior_mean()[self.last].mean()),
                "sampled_success": self.last_sampled}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "alpha": self.alpha_P.tolist(), "beta": self.beta_P.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.alpha_P = np.array(state["alpha"], dtype=np.float64)
        self.beta_P = np.array(state["beta"], dtype=np.float64)


def similarity_predict(features_PD: np.ndarray, ref_features_MD: np.ndarray, ref_rates_M: np.ndarray,
                       temperature: float) -> np.ndarray:
    """DOTS-style attention prediction: for each prompt p,
    pred_p = Σ_m softmax_m(cos(x_p, x_m) / temperature) · rate_m, over M reference prompts.
    Features are L2-normalised, so cos is a dot product. Shapes (P, D), (M, D), (M,) → (P,)."""
    weights_PM = _softmax(features_PD @ ref_features_MD.T, temperature)
    return weights_PM @ np.asarray(ref_rates_M, dtype=np.float64)


class DOTSSampler:
    """Difficulty-targeted Online daTa Selection ("Improving Data Efficiency for LLM
    Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
    Replay", arXiv:2506.05316). Rollout replay lives in rlvr.train (sampler.replay).

    Every batch holds ref_size reference prompts drawn uniformly at random (without replacement);
    they are rolled out and trained on like the rest, and their observed accuracies are the
    only evidence the predictor uses (chosen prompts' outcomes are not, so the evidence is an
    unbiased sample). The predictor keeps each reference prompt's latest accuracy, for the
    ref_memory most recently observed reference prompts, and predicts every prompt's success
    rate as `similarity_predict` over them: a softmax over cosine similarities of
    `text_features` with a temperature. The rest of the batch is the prompts (other than the
    references and those already chosen this step) whose prediction is closest to target, ties
    broken at random. Before any reference is observed every prediction is 0.5, so the first
    batch is uniform.

    Departures and choices (the paper's exact attention predictor was not available to us):
    the paper embeds prompts with a pretrained encoder and predicts from freshly rolled-out
    reference prompts; here the embedding is a hashed character-n-gram TF-IDF vector (no
    downloads), the predictor is the plain softmax-weighted average above (no learned
    calibration), and the references of recent steps are pooled (ref_memory), because
    references are picked in the same call as the rest of the batch, so their outcomes are one
    step old in any case. A batch of n < 2·ref_size (a strategy asking for a few more prompts)
    holds n // 2 references.
    Defaults (ours): ref_size 2 (a quarter of the default 8-prompt batch), target 0.5,
    temperature 0.1, ref_memory 256, feature_dim 1024."""

    def __init__(self, ctx: SamplerContext, *, ref_size: int = 2, target: float = 0.5, temperature: float = 0.1,
                 ref_memory: int = 256, feature_dim: int = 1024) -> None:
        if ref_size < 1 or ref_memory < 1 or temperature <= 0:
            raise ValueError("sampler 'dots': need ref_size ≥ 1, ref_memory ≥ 1, temperature > 0")
        self.features_PD = text_features(ctx.texts, dim=feature_dim)
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.ref_size, self.target, self.temperature, self.ref_memory = ref_size, target, temperature, ref_memory
        self.memory: dict[int, float] = {}
        """Reference prompt → its latest accuracy, oldest observation first."""
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.pending_refs: list[int] = []
        self.last_pred: dict[int, float] = {}
        self.last_error = 0.0

    def predict(self) -> np.ndarray:
        if not self.memory:
            return np.full(self.num_prompts, 0.5)
        refs = np.fromiter(self.memory, dtype=np.int64)
        return similarity_predict(self.features_PD, self.features_PD[refs],
                                  np.fromiter(self.memory.values(), dtype=np.float64), self.temperature)

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "dots", self.calls)
        n_refs = min(self.ref_size, n // 2)
        refs = _draw(rng, _allowed(self.num_prompts, self.pending, n_refs), n_refs)
        pool = _allowed(self.num_prompts, self.pending + refs, n - n_refs)
        pred_P = self.predict()
        rest = _closest(rng, pool, pred_P[pool], self.target, n - n_refs)
        self.last_pred = {i: float(pred_P[i]) for i in rest}
        out = refs + rest
        self.calls, self.drawn = self.calls + 1, self.drawn + n
        self.pending, self.pending_refs = self.pending + out, self.pending_refs + refs
        return out

    def observe(self, groups: list[Group]) -> None:
        refs, errors = set(self.pending_refs), []
        for g in groups:
            if not g.samples:
                continue
            i, acc = _prompt(g), _accuracy(g)
            if i in refs:
                self.memory.pop(i, None)
                self.memory[i] = acc
            elif i in self.last_pred:
                errors.append(abs(self.last_pred[i] - acc))
        while len(self.memory) > self.ref_memory:
            del self.memory[next(iter(self.memory))]
        self.last_error = float(np.mean(errors)) if errors else self.last_error
        self.pending, self.pending_refs = [], []

    def metrics(self) -> dict[str, float]:
        pred = float(np.mean(list(self.last_pred.values()))) if self.last_pred else 0.5
        return {"predicted_success": pred, "prediction_error": self.last_error, "memory": float(len(self.memory))}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "pending_refs": list(self.pending_refs), "memory": [[i, r] for i, r in self.memory.items()],
                "last_error": self.last_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.pending_refs = [int(i) for i in state["pending_refs"]]
        self.memory = {int(i): float(r) for i, r in state["memory"]}
        self.last_error = float(state.get("last_error", 0.0))  # a metric carried between steps


def logistic_sgd_step(w_D: np.ndarray, b: float, features_BD: np.ndarray, targets_B: np.ndarray, lr: float,
                      l2: float) -> tuple[np.ndarray, float]:
    """One gradient step of logistic regression with soft targets in [0, 1]:
    v = σ(x·w + b), loss = mean cross-entropy(v, target) + l2/2·|w|²,
    ∂loss/∂w = mean((v − target)·x) + l2·w,  ∂loss/∂b = mean(v − target). Returns (w, b)."""
    v_B = 1.0 / (1.0 + np.exp(-(features_BD @ w_D + b)))
    err_B = v_B - targets_B
    return w_D - lr * (err_B @ features_BD / len(err_B) + l2 * w_D), b - lr * float(err_B.mean())


class PCLSampler:
    """Prompt Curriculum Learning ("Prompt Curriculum Learning for Efficient LLM
    Post-Training", arXiv:2510.01135): a value model V(x) predicts each prompt's expected
    reward (here: accuracy) under the current policy; each step draw candidates_factor·n
    candidates uniformly (without replacement), keep the n with V(x) closest to target (0.5),
    and after the update train V on the observed group accuracies. No extra rollouts.

    Departure: the paper's value model is a small language model trained with squared error;
    here V(x) = σ(w·φ(x) + b), linear in `text_features` φ, trained online by `updates` full
    gradient steps of soft-label logistic regression (cross-entropy, whose gradient does not
    vanish at saturated predictions as the squared error on a sigmoid does) on each observe's
    groups. It starts at w = 0, b = 0 (every prediction 0.5: the first batch is uniform).
    Defaults (ours): target 0.5, candidates_factor 4, lr 2.0, l2 1e-4, updates 4,
    feature_dim 1024."""

    def __init__(self, ctx: SamplerContext, *, target: float = 0.5, candidates_factor: float = 4.0, lr: float = 2.0,
                 l2: float = 1e-4, updates: int = 4, feature_dim: int = 1024) -> None:
        if candidates_factor < 1 or lr <= 0 or l2 < 0 or updates < 1:
            raise ValueError("sampler 'pcl': need candidates_factor ≥ 1, lr > 0, l2 ≥ 0, updates ≥ 1")
        self.features_PD = text_features(ctx.texts, dim=feature_dim)
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.target, self.candidates_factor, self.lr, self.l2, self.updates = target, candidates_factor, lr, l2, updates
        self.w_D, self.b = np.zeros(feature_dim), 0.0
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last_pred, self.last_mse = 0.5, 0.0

    def predict(self, indices: np.ndarray | list[int]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.features_PD[indices] @ self.w_D + self.b)))

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "pcl", self.calls)
        allowed = _allowed(self.num_prompts, self.pending, n)
        pool = np.array(_draw(rng, allowed, min(len(allowed), math.ceil(self.candidates_factor * n))))
        out = _closest(rng, pool, self.predict(pool), self.target, n)
        self.last_pred = float(self.predict(out).mean())
        self.calls, self.drawn, self.pending = self.calls + 1, self.drawn + n, self.pending + out
        return out

    def observe(self, groups: list[Group]) -> None:
        kept = [g for g in groups if g.samples]
        if kept:
            idx = [_prompt(g) for g in kept]
            acc_B = np.array([_accuracy(g) for g in kept])
            self.last_mse = float(((self.predict(idx) - acc_B) ** 2).mean())
            for _ in range(self.updates):
                self.w_D, self.b = logistic_sgd_step(self.w_D, self.b, self.features_PD[idx], acc_B, self.lr, self.l2)
        self.pending = []

    def metrics(self) -> dict[str, float]:
        return {"predicted_success": self.last_pred, "value_mse": self.last_mse}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "w": self.w_D.tolist(), "b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.w_D, self.b = np.array(state["w"], dtype=np.float64), float(state["b"])
