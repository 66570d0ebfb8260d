"""Drawing one token from one row of logits, and the logprob it is recorded with. Pure functions.

The recorded logprob is log softmax(logits / T)[token]: the distribution the token was drawn from
with the temperature applied but *before* top-p/top-k truncation (`clawbridge.types.Completion`),
so that `score` at the same temperature reproduces it and the PPO ratio is exactly 1 on-policy.
Greedy decoding (T = 0) records the logprob under T = 1.

The draw is an inverse-CDF lookup of one uniform number `u` from the request's own generator:
the same seed gives the same tokens whatever else shares the batch, and it runs on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from clawbridge.types import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float
    top: tuple[TokenLogprob, ...] | None = None


def needs_uniform(params: SamplingParams) -> bool:
    return params.temperature > 0


def draw_token(logits: torch.Tensor, params: SamplingParams, u: float) -> Draw:
    """One token from `logits` [V] under `params`; `u` in [0, 1) drives the draw."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = torch.log_softmax(scaled, dim=-1)
    if params.temperature <= 0:
        token = int(torch.argmax(logp))
    else:
        token = _inverse_cdf(logp, params, u)
    top = None
    if params.top_logprobs > 0:
        values, ids = torch.topk(logp, min(params.top_logprobs, logp.shape[-1]))
        top = tuple(
            TokenLogprob(int(i), float(v))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        )
    return Draw(token, float(logp[token]), top)


def _inverse_cdf(logp: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Sample from softmax truncated by top-k then top-p (nucleus), renormalised.

    The CDF runs over the vocabulary in id order, not in sorted order: a rounding-level change
    of the logits (another batch shape) then moves a boundary by a rounding-level amount instead
    of reshuffling which token sits under `u`. That keeps seeded draws batch-independent."""
    vocab = logp.shape[-1]
    probs = logp.double().exp()
    truncate_k = 0 < params.top_k < vocab
    if truncate_k or params.top_p < 1.0:
        if truncate_k:
            values, ids = torch.topk(logp, params.top_k)
        else:
            values, ids = torch.sort(logp, descending=True)
        if params.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            kept = values.double().exp()
            keep = int(((torch.cumsum(kept, 0) - kept) < params.top_p).sum())
            ids = ids[:keep]
        truncated = torch.zeros_like(probs)
        truncated[ids] = probs[ids]
        probs = truncated
    cdf = torch.cumsum(probs, 0)
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    # right=True never lands on a zero-probability (truncated) token
    return int(torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1))


def _plain(params: SamplingParams) -> bool:
    """Drawn from the whole distribution with nothing else to report (greedy or T > 0 without
    truncation): the case a batch can draw in one go. RL sampling is this case (T = 1, top_p 1)."""
    return params.top_k <= 0 and params.top_p >= 1.0 and params.top_logprobs <= 0


def draw_tokens(logits: torch.Tensor, params: list[SamplingParams], us: list[float]) -> list[Draw]:
    """One token per row of `logits` [R, V] (row i under params[i], driven by us[i]): what
    `draw_token` gives each row alone, with the plain rows drawn together so a decode step costs a
    few kernels and one host transfer instead of a handful per row."""
    out: list[Draw | None] = [None] * len(params)
    plain = [i for i, p in enumerate(params) if _plain(p)]
    for i, p in enumerate(params):
        if i not in plain:
            out[i] = draw_token(logits[i], p, us[i])
    if plain:
        index = torch.tensor(plain, device=logits.device)
        rows = logits.index_select(0, index).float()
        temps = torch.tensor(
            [params[i].temperature if params[i].temperature > 0 else 1.0 for i in plain],
            device=logits.device,
        )
        logp = torch.log_softmax(rows / temps[:, None], dim=-1)
        greedy = torch.tensor([params[i].temperature <= 0 for i in plain], device=logits.device)
        # the same inverse CDF as `_inverse_cdf` without truncation, row by row
        cdf = torch.cumsum(logp.double().exp(), dim=-1)
        target = (
            torch.tensor([us[i] for i in plain], dtype=cdf.dtype, device=cdf.device)[:, None]
            * cdf[:, -1:]
        )
        drawn = (
            torch.searchsorted(cdf, target, right=True).clamp(max=logp.shape[-1] - 1).squeeze(-1)
        )
        tokens = torch.where(greedy, logp.argmax(dim=-1), drawn)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
        for i, token, logprob in zip(plain, tokens.tolist(), chosen.tolist(), strict=True):
            out[i] = Draw(int(token), float(logprob))
    return [d for d in out if d is not None]
