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
    if temperature > 0 and temperature != 1:
        # shifted by the row's largest first (the same distribution): a tiny temperature then sends
        # the others to -inf, where the unshifted logits / 1e-38 made inf - inf = nan
        logits_BV = (logits_BV - logits_BV.amax(-1, keepdim=True)) / temperature
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
    uniforms_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens_B, logprobs_B). temperature = 0 is greedy.

    Sampling inverts the cumulative distribution: one uniform u per row, token = the first index
    whose cumulative probability exceeds u·total. It draws exactly from the distribution (the
    cumulative sum is in float64, and a token of probability 0 is never drawn) and needs one random
    number per row. Gumbel-max needs one per vocabulary entry, and drawing 64 × 49,152 of them cost
    ~80-135 ms per decode step here, a quarter of the step (docs/LOG.md).

    ``uniforms_B`` gives those uniforms (in [0, 1), float64), one per row, instead of drawing them
    from ``generator``: the embedded engine keeps one stream per sample.
    """
    logprobs_BV = process_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
    if temperature == 0:
        tokens_B = logprobs_BV.argmax(-1)
    else:
        cdf_BV = logprobs_BV.double().exp_().cumsum_(-1)
        u_B1 = (uniforms_B.to(torch.float64)[:, None] if uniforms_B is not None else
                torch.rand((cdf_BV.shape[0], 1), generator=generator, dtype=torch.float64, device=cdf_BV.device))
        # u < 1, and the factor keeps u·total strictly below the total despite rounding
        target_B1 = u_B1 * cdf_BV[:, -1:] * (1 - 2**-52)
        tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
