"""Token sampling from logits: temperature, top-k, top-p, and the log-probability of what was drawn."""

from __future__ import annotations

import torch


def process_logits(
    logits_BV: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of the distribution the engine samples from, in float32.

    Temperature scales the logits; top-k keeps the k largest; top-p (nucleus, Holtzman et al.,
    arXiv:1904.09751) keeps the smallest set of most likely tokens whose probability reaches top_p.
    Removed tokens get -inf, and the rest is renormalised, so the log-probability returned for a
    sampled token is exactly that of the sampling distribution.
    """
    logits_BV = logits_BV.float()
    if temperature > 0:
        logits_BV = logits_BV / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        logits_BV = torch.empty_like(logits_BV).scatter_(-1, order_BV, sorted_BV)
    return logits_BV.log_softmax(-1)


def sample_tokens(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens_B, logprobs_B). temperature = 0 is greedy.

    Sampling uses the Gumbel-max trick, argmax(logp + g) with g = -log(E), E ~ Exp(1), which draws
    exactly from softmax(logp) and is cheaper than torch.multinomial over a large vocabulary.
    """
    logprobs_BV = process_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        tokens_B = logprobs_BV.argmax(-1)
    else:
        noise_BV = torch.empty_like(logprobs_BV).exponential_(generator=generator).log_()
        tokens_B = (logprobs_BV - noise_BV).argmax(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
