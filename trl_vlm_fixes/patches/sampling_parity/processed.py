"""Tensor core of sampling_parity: the trainer's log-probability of each sampled token under vLLM's processed
distribution, from the hidden states of the scoring pass TRL already runs and the model's own output layer.

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

The logits come from the hidden states that predict each scored token times the output layer (TRL 1.16 never
materializes them: its fused head scores in tiles), in chunks of positions and without gradient, so no tensor of the
full [tokens x vocabulary] size is ever held. A ban alone (at TRL's own temperature) needs no logits at all: the
banned tokens' logits and the sampled one's are gathered, the normaliser is TRL's own (its log-prob of the sampled
token), and the kept share is 1 minus the banned share, a subtraction; only a position where the banned share may be
most of the mass (where that subtraction would lose float32's digits) gets its logits to sum the kept tokens
directly. The sampled token is always kept (a numerical difference can put it just outside the trainer's own cut).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .distribution import SamplingDistribution

CHUNK_ELEMENTS = 1 << 24  # logits per chunk (64 MiB in float32): positions per chunk = this // vocabulary
TOP_P_CANDIDATES = 64  # largest logits looked at first for the top-p boundary
DOMINANT_SHARE = 0.5  # above this bound on the banned share, the kept tokens are summed directly


class OutputLayer:
    """The trainer's output projection, applied to chosen hidden states only (the scoring pass's own weights)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def vocabulary(self) -> int:
        return int(self.weight.size(0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocabulary] float32 (the projection runs in the weight's dtype, as the model's own does)."""
        logits = hidden.to(self.weight.dtype) @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        return logits.to(torch.float32)

    def columns(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """[rows, k] float32: the logits of ``token_ids`` [k] at every row."""
        rows = self.weight[token_ids].to(torch.float32)
        logits = hidden.to(torch.float32) @ rows.T
        if self.bias is not None:
            logits = logits + self.bias[token_ids].to(torch.float32)
        return logits

    def sampled(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[rows] float32: each row's logit of its own token ``ids`` [rows]."""
        logits = (hidden.to(torch.float32) * self.weight[ids].to(torch.float32)).sum(dim=-1)
        if self.bias is not None:
            logits = logits + self.bias[ids].to(torch.float32)
        return logits


@dataclass
class Scored:
    """One chunk of scored positions. ``processed`` (the trainer's log-prob of the sampled token under vLLM's
    distribution) and ``log_kept`` (log of the share of the trainer's distribution the settings keep, at the sampling
    temperature) are NaN where they follow from TRL's own log-prob (``finish``): the ban's subtraction."""

    processed: torch.Tensor
    log_kept: torch.Tensor
    sampled_logit: torch.Tensor  # the sampled token's logit at the sampling temperature
    banned_lse: torch.Tensor  # logsumexp of the banned tokens' logits but the sampled one, at the sampling temperature

    def finish(self, trl_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, log_kept) [rows]: TRL's log-prob + shift = the processed log-prob."""
        trl = trl_logps.to(torch.float32).reshape(-1)
        lse = self.sampled_logit - trl  # TRL's normaliser (the ban path runs at TRL's own temperature)
        log_kept_ban = torch.log1p(-torch.exp(self.banned_lse - lse).clamp(max=1.0))
        pending = torch.isnan(self.processed)
        processed = torch.where(pending, trl - log_kept_ban, self.processed)
        log_kept = torch.where(pending, log_kept_ban, self.log_kept)
        return processed - trl, log_kept


@torch.no_grad()
def score(
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    layer: OutputLayer,
    distribution: SamplingDistribution,
    trainer_temperature: float,
) -> Scored:
    """For the hidden states [..., H] that predict the sampled ids [...]: one ``Scored`` over all positions."""
    flat = hidden.reshape(-1, hidden.size(-1))
    ids = token_ids.reshape(-1).to(device=hidden.device, dtype=torch.long)
    parts = []
    rows = max(1, CHUNK_ELEMENTS // layer.vocabulary)
    for start in range(0, flat.size(0), rows):
        end = min(start + rows, flat.size(0))
        parts.append(_score_chunk(flat[start:end], ids[start:end], layer, distribution, trainer_temperature))
    return Scored(*(torch.cat([getattr(p, name) for p in parts]) for name in Scored.__dataclass_fields__))


def _ban_alone(distribution: SamplingDistribution, trainer_temperature: float) -> bool:
    plain = not (distribution.truncates or distribution.biases or distribution.allowed is not None)
    return plain and distribution.temperature == trainer_temperature


def _score_chunk(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    layer: OutputLayer,
    distribution: SamplingDistribution,
    trainer_temperature: float,
) -> Scored:
    rows = hidden.size(0)
    nan = torch.full((rows,), math.nan, device=hidden.device)
    temperature = distribution.temperature
    if not _ban_alone(distribution, trainer_temperature):
        processed, log_kept = _processed_general(layer.logits(hidden), ids, distribution)
        return Scored(processed, log_kept, nan.clone(), nan.clone())
    sampled = layer.sampled(hidden, ids) / temperature
    if not distribution.banned:
        zeros = torch.zeros(rows, device=hidden.device)
        return Scored(nan.clone(), nan.clone(), sampled, zeros - math.inf)
    banned_ids = torch.tensor(distribution.banned, device=hidden.device)
    banned = layer.columns(hidden, banned_ids) / temperature
    banned.masked_fill_(banned_ids.unsqueeze(0) == ids.unsqueeze(1), -math.inf)  # the sampled token is kept
    banned_lse = torch.logsumexp(banned, dim=-1)
    # the true normaliser is at least logaddexp(sampled, banned): a bound on the banned share, from gathers alone
    share_bound = torch.exp(banned_lse - torch.logaddexp(sampled, banned_lse))
    processed, log_kept = nan.clone(), nan.clone()
    dominant = (share_bound > DOMINANT_SHARE).nonzero().squeeze(1)
    if dominant.numel():
        exact = _processed_general(layer.logits(hidden[dominant]), ids[dominant], distribution)
        processed[dominant], log_kept[dominant] = exact
    return Scored(processed, log_kept, sampled, banned_lse)


def _processed_general(
    logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution
) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed log-prob of each row's token, log kept share) from raw logits [rows, vocab], as vLLM applies its
    settings: allowed ids, bans, biases, temperature, then the three cuts. ``logits`` is overwritten."""
    ids = ids.unsqueeze(1)
    y = logits.div_(distribution.temperature)  # the model's distribution at the sampling temperature
    plain_lse = torch.logsumexp(y, dim=-1)
    plain_sampled = y.gather(1, ids).squeeze(1)
    if distribution.allowed is not None:
        outside = torch.ones(y.size(1), dtype=torch.bool, device=y.device)
        outside[torch.tensor(distribution.allowed, device=y.device)] = False
        y.masked_fill_(outside, -math.inf)
    bias_ids = None
    if distribution.biases:
        bias_ids = torch.tensor([token for token, _ in distribution.biases], device=y.device)
        bias = torch.tensor([value for _, value in distribution.biases], device=y.device) / distribution.temperature
        y.index_add_(1, bias_ids, bias.expand(y.size(0), -1))
    sampled = y.gather(1, ids)  # its value before bans and cuts: "always kept" restores it
    if distribution.banned:
        y.index_fill_(1, torch.tensor(distribution.banned, device=y.device), -math.inf)
    y.masked_fill_(y < _threshold(y, distribution), -math.inf)
    y.scatter_(1, ids, sampled)
    processed = sampled.squeeze(1) - torch.logsumexp(y, dim=-1)
    # the kept share, measured on the distribution without biases: undo them on the kept tokens
    if bias_ids is not None:
        kept = y > -math.inf
        y.index_add_(1, bias_ids, -bias.expand(y.size(0), -1))
        y.masked_fill_(~kept, -math.inf)
        y.scatter_(1, ids, plain_sampled.unsqueeze(1))
    return processed, torch.logsumexp(y, dim=-1) - plain_lse


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
        boundary[unresolved] = _top_p_boundary(
            full, threshold[unresolved], survivors_lse[unresolved], distribution.top_p
        )[0]
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
