"""Tolerances for bf16 comparisons, derived from bf16's rounding instead of tuned to one run.

bf16 keeps 8 significant bits (7 stored, 1 implicit), so one rounding to nearest has relative
error at most U_BF16 = 2^-8 (fp32: 2^-24). A forward pass rounds every activation, so two bf16
computations of the same log-prob by different kernels (the engine's cached decode and the
learner's full forward, a packed batch and a single row) differ by the accumulated rounding of
the network, which no closed formula bounds usefully. It can be measured, though: the same
network in float64 on the same (bf16-valued) weights gives the exact value, and
``logprob_noise`` is how far bf16 lands from it. Two bf16 computations each within that noise of
the exact value are within twice it of each other (triangle inequality); the tests allow three
times, for the other kernel's different rounding. A wrong formula or a misplaced position is
off by far more than rounding noise.
"""

from __future__ import annotations

import copy

import torch

U_BF16 = 2.0**-8


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1.., in float64 whatever the model's dtype."""
    x = torch.tensor([ids])
    logp = model(input_ids=x).logits[0, :-1].double().log_softmax(-1)
    return logp.gather(1, x[0, 1:, None])[:, 0]


def exact_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights (bf16 values are exact in float64), computed in float64."""
    return copy.deepcopy(model).to(torch.float64)


def logprob_noise(model: torch.nn.Module, ids: list[int]) -> float:
    """The largest |bf16 log-prob − exact log-prob| of this bf16 model over the tokens of ``ids``."""
    return float((token_logprobs(model, ids) - token_logprobs(exact_copy(model), ids)).abs().max())
