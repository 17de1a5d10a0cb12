"""Tensor core of sampling_parity: the trainer's log-probability of each sampled token under vLLM's processed
distribution, from the logits of the scoring pass TRL already runs.

vLLM's sampler (0.25.1, ``processed_logprobs``) returns log p(t) over the tokens its settings keep:
``allowed_token_ids`` and bans set the others to -inf, ``logit_bias`` is added, the temperature divides, then
``min_p``, top-k and top-p cut (in that order), and the result is renormalised. Each cut keeps exactly the tokens
whose logit is at least a per-position threshold, so the kept set is ``y >= tau`` with ``tau`` the largest of the
three thresholds:

- min_p keeps p_i >= min_p * p_max, i.e. y_i >= y_max + log(min_p);
- top-k keeps the k largest (ties included);
- top-p keeps a token while the mass of the kept tokens ranked above it is below p (vLLM sorts ascending and drops
  those whose cumulative mass is at most 1 - p, always keeping the largest): found among the largest candidates
  (``torch.topk``), with a full sort only for a row whose boundary lies beyond them.

A ban alone needs no threshold: the kept share is 1 minus the banned tokens' share (no sort). The sampled token is
always kept (a numerical difference can put it just outside the trainer's own cut). Everything runs without gradient,
over chunks of positions, so no second tensor of the logits' full size ([tokens x vocab]) is ever held.
"""

from __future__ import annotations

import math

import torch

from .distribution import SamplingDistribution

CHUNK_ELEMENTS = 1 << 24  # float32 values per chunk (64 MiB): positions per chunk = this // vocab
TOP_P_CANDIDATES = 64  # largest logits looked at first for the top-p boundary


@torch.no_grad()
def processed_shift(
    logits: torch.Tensor, token_ids: torch.Tensor, distribution: SamplingDistribution, trainer_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits [..., vocab] (raw, any dtype) and the sampled ids [...]: (shift, log_kept), float32 [...].

    ``shift`` = log p_processed(t) - log p_full(t), the first at the sampling temperature after vLLM's settings, the
    second at ``trainer_temperature`` over the full vocabulary (what TRL's scoring computes), so that TRL's log-prob +
    shift is the trainer's log-prob of the distribution vLLM sampled from. ``log_kept`` = log of the share of the
    trainer's distribution (at the sampling temperature, before any bias) that the settings keep.
    """
    vocab = logits.size(-1)
    flat = logits.reshape(-1, vocab)
    ids = token_ids.reshape(-1, 1).to(device=logits.device, dtype=torch.long)
    shift = torch.empty(flat.size(0), dtype=torch.float32, device=logits.device)
    log_kept = torch.empty_like(shift)
    rows = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, flat.size(0), rows):
        end = min(start + rows, flat.size(0))
        chunk = _chunk(flat[start:end], ids[start:end], distribution, trainer_temperature)
        shift[start:end], log_kept[start:end] = chunk
    return shift.reshape(token_ids.shape), log_kept.reshape(token_ids.shape)


def _chunk(
    raw: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution, trainer_temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    temperature = distribution.temperature
    z = raw.to(dtype=torch.float32, copy=True)  # the only [chunk x vocab] copy; TRL's logits are never written
    if trainer_temperature != temperature:
        full = z / trainer_temperature
        full_t = (full.gather(1, ids) - torch.logsumexp(full, dim=-1, keepdim=True)).squeeze(1)
        del full
    y = z.div_(temperature)  # the model's distribution at the sampling temperature, before any setting
    plain_lse = torch.logsumexp(y, dim=-1, keepdim=True)
    if trainer_temperature == temperature:
        full_t = (y.gather(1, ids) - plain_lse).squeeze(1)
    if not (distribution.truncates or distribution.biases or distribution.allowed is not None):
        log_kept = _kept_share_after_bans(y, ids, plain_lse, distribution.banned)
        processed_t = y.gather(1, ids).squeeze(1) - (plain_lse.squeeze(1) + log_kept)
        return processed_t - full_t, log_kept
    return _processed_general(y, raw, ids, plain_lse, distribution, full_t)


def _kept_share_after_bans(
    y: torch.Tensor, ids: torch.Tensor, plain_lse: torch.Tensor, banned: tuple[int, ...]
) -> torch.Tensor:
    """log(1 - share of the banned tokens other than the sampled one): a subtraction, no sort. Where the banned share
    is most of the mass the subtraction would cancel away float32's digits: those rows sum the kept tokens directly."""
    if not banned:
        return torch.zeros(y.size(0), dtype=torch.float32, device=y.device)
    banned_ids = torch.tensor(banned, device=y.device)
    values = y.index_select(1, banned_ids)
    sampled_banned = banned_ids.unsqueeze(0) == ids
    values.masked_fill_(sampled_banned, -math.inf)  # the sampled token is kept
    banned_share = torch.exp(torch.logsumexp(values, dim=-1, keepdim=True) - plain_lse).squeeze(1)
    log_kept = torch.log1p(-banned_share.clamp(max=1.0))
    dominant = (banned_share > 0.5).nonzero().squeeze(1)
    if dominant.numel():
        rows = y[dominant]
        out = torch.zeros_like(rows, dtype=torch.bool)
        out[:, banned_ids] = ~sampled_banned[dominant]
        kept_lse = torch.logsumexp(rows.masked_fill(out, -math.inf), dim=-1)
        log_kept[dominant] = kept_lse - plain_lse[dominant].squeeze(1)
    return log_kept


def _processed_general(
    y: torch.Tensor,
    raw: torch.Tensor,
    ids: torch.Tensor,
    plain_lse: torch.Tensor,
    distribution: SamplingDistribution,
    full_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bans, biases, allowed ids and the three cuts, as vLLM applies them, on ``y`` (overwritten)."""
    if distribution.allowed is not None:
        outside = torch.ones(y.size(1), dtype=torch.bool, device=y.device)
        outside[torch.tensor(distribution.allowed, device=y.device)] = False
        y.masked_fill_(outside, -math.inf)
    if distribution.biases:
        bias_ids = torch.tensor([token for token, _ in distribution.biases], device=y.device)
        bias = torch.tensor([value for _, value in distribution.biases], device=y.device) / distribution.temperature
        y.index_add_(1, bias_ids, bias.expand(y.size(0), -1))
    sampled = y.gather(1, ids)  # its value before bans and cuts: "always kept" restores it
    if distribution.banned:
        y.index_fill_(1, torch.tensor(distribution.banned, device=y.device), -math.inf)
    threshold = _threshold(y, distribution)
    y.masked_fill_(y < threshold, -math.inf)
    y.scatter_(1, ids, sampled)
    kept_lse = torch.logsumexp(y, dim=-1)
    processed_t = sampled.squeeze(1) - kept_lse
    if distribution.biases:  # the kept share is measured on the unbiased distribution
        plain = raw.to(torch.float32) / distribution.temperature
        kept_plain = torch.logsumexp(plain.masked_fill(y == -math.inf, -math.inf), dim=-1)
        log_kept = kept_plain - plain_lse.squeeze(1)
    else:
        log_kept = kept_lse - plain_lse.squeeze(1)
    return processed_t - full_t, log_kept


def _threshold(y: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    """The smallest logit min_p, then top-k, then top-p keep, per row [rows, 1] (-inf: all)."""
    threshold = torch.full((y.size(0), 1), -math.inf, device=y.device)
    if distribution.min_p > 0:
        threshold = torch.maximum(threshold, y.amax(dim=-1, keepdim=True) + math.log(distribution.min_p))
    if 0 < distribution.top_k < y.size(1):
        kth = torch.topk(y, distribution.top_k, dim=-1).values[:, -1:]
        threshold = torch.maximum(threshold, kth)
    if distribution.top_p < 1.0:
        threshold = torch.maximum(threshold, _top_p_threshold(y, threshold, distribution))
    return threshold


def _top_p_threshold(y: torch.Tensor, threshold: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    """The smallest logit top-p keeps among the tokens at or above ``threshold``."""
    survivors_lse = torch.logsumexp(y.masked_fill(y < threshold, -math.inf), dim=-1, keepdim=True)
    candidates = min(y.size(1), max(TOP_P_CANDIDATES, distribution.top_k))
    values = torch.topk(y, candidates, dim=-1).values  # descending
    boundary, resolved = _top_p_boundary(values, threshold, survivors_lse, distribution.top_p)
    unresolved = (~resolved).nonzero().squeeze(1)
    if unresolved.numel():  # the boundary lies beyond the candidates: sort those rows in full
        full = torch.sort(y[unresolved], dim=-1, descending=True).values
        boundary[unresolved] = _top_p_boundary(full, threshold[unresolved], survivors_lse[unresolved],
                                               distribution.top_p)[0]
    return boundary


def _top_p_boundary(
    values: torch.Tensor, threshold: torch.Tensor, survivors_lse: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest kept value [rows, 1], whether it was found among ``values``) for descending ``values``."""
    valid = values >= threshold
    probabilities = torch.exp(values - survivors_lse) * valid
    cumulative = torch.cumsum(probabilities, dim=-1)
    kept = valid & (cumulative - probabilities < top_p)
    kept[:, 0] = True  # the largest is always kept
    last = kept.sum(dim=-1, keepdim=True) - 1
    boundary = values.gather(1, last)
    resolved = (cumulative[:, -1] >= top_p) | ~valid[:, -1] | (values.size(1) == 1)
    return boundary, resolved
