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
  (``torch.topk`` of 64, then of 2,048), with a full sort only for a row whose boundary lies beyond them.

The logits are read, a chunk of positions at a time and without gradient, from the model's own where its output
layer ran (TRL 1.9.1) or projected from the hidden states that predict each scored token (TRL 1.16's fused head never
materializes them), so no second tensor of the full [tokens x vocabulary] size is ever held. A ban alone (at TRL's
own temperature) needs no pass over the vocabulary: the banned tokens' logits and the sampled one's are gathered,
the normaliser is TRL's own (its log-prob of the sampled token), and the kept share is 1 minus the banned share, a
subtraction; only a position where the banned share may be most of the mass (where that subtraction would lose
float32's digits) gets its logits to sum the kept tokens directly. The sampled token is always kept (a numerical
difference can put it just outside the trainer's own cut).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .distribution import SamplingDistribution

# logits per chunk (256 MiB in float32; 270 positions at Qwen3.5's 248,320 tokens; a row that needs the full sort
# adds its values and int64 indices: 1.8-1.9 GiB at the peak, measured on the CPU). Each chunk costs a fixed ~2.4 ms
# on an H100 (kernel launches and host syncs, by our reading; not profiled): at a 9B-class shape, bf16, 2,048 scored
# tokens, truncation took 76.5 ms in chunks of 2**24 and 19.2 ms in chunks of 2**26 (benchmarks/
# sampling_parity_cost.py, docs/gpu-results.md section 10).
CHUNK_ELEMENTS = 1 << 26
TOP_P_CANDIDATES = (64, 2048)  # largest logits looked at for the top-p boundary, before a full sort
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


class Positions:
    """The logits of the scored positions: read from the model's own where its output layer ran (TRL 1.9.1), else
    projected from the hidden states that predict them (TRL 1.16's fused head keeps none), a chunk at a time."""

    def __init__(self, hidden: torch.Tensor, layer: OutputLayer, logits: torch.Tensor | None = None) -> None:
        self.hidden = hidden.reshape(-1, hidden.size(-1))
        self.layer = layer
        self.raw = logits.reshape(-1, logits.size(-1)) if logits is not None else None

    def __len__(self) -> int:
        return self.hidden.size(0)

    def view(self, index: slice) -> torch.Tensor:
        """[rows, vocabulary] in the model's dtype, to be read only (TRL's own logits, or a fresh projection)."""
        if self.raw is not None:
            return self.raw[index]
        logits = self.hidden[index].to(self.layer.weight.dtype) @ self.layer.weight.T
        return logits if self.layer.bias is None else logits + self.layer.bias

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """[rows, vocabulary] float32, a copy the caller may overwrite."""
        if self.raw is not None:
            return self.raw[index].to(torch.float32, copy=True)
        return self.layer.logits(self.hidden[index])

    def columns(self, index: slice, token_ids: torch.Tensor) -> torch.Tensor:
        """[rows, k] float32: the logits of ``token_ids`` [k] at the rows ``index`` (never a row in full)."""
        if self.raw is not None:
            return self.raw[index].index_select(1, token_ids).to(torch.float32)
        logits = self.hidden[index].to(torch.float32) @ self.layer.weight[token_ids].to(torch.float32).T
        bias = self.layer.bias
        return logits if bias is None else logits + bias[token_ids].to(torch.float32)

    def sampled(self, index: slice, ids: torch.Tensor) -> torch.Tensor:
        """[rows] float32: each row's logit of its own token ``ids``."""
        if self.raw is not None:
            return self.raw[index].gather(1, ids.unsqueeze(1)).squeeze(1).to(torch.float32)
        rows = self.layer.weight[ids].to(torch.float32)
        logits = (self.hidden[index].to(torch.float32) * rows).sum(dim=-1)
        bias = self.layer.bias
        return logits if bias is None else logits + bias[ids].to(torch.float32)


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
    positions: Positions, token_ids: torch.Tensor, distribution: SamplingDistribution, trainer_temperature: float
) -> Scored:
    """For the scored positions and their sampled ids [...]: one ``Scored`` over all of them."""
    ids = token_ids.reshape(-1).to(device=positions.hidden.device, dtype=torch.long)
    if _ban_alone(distribution, trainer_temperature):
        # per position: the banned logits, and three float32 rows of the hidden size (``Positions.sampled``)
        chunks = _chunks(len(positions), len(distribution.banned) + 3 * positions.hidden.size(-1))
        parts = [_ban(positions, index, ids[index], distribution) for index in chunks]
        return Scored(*(torch.cat([getattr(p, name) for p in parts]) for name in Scored.__dataclass_fields__))
    general = distribution.biases or distribution.allowed is not None
    cut = [
        _processed_general(positions.rows(index), ids[index], distribution)
        if general
        else _cuts(positions, index, ids[index], distribution)
        for index in _chunks(len(positions), positions.layer.vocabulary)
    ]
    processed, log_kept = (torch.cat(values) for values in zip(*cut, strict=True))
    nan = torch.full_like(processed, math.nan)
    return Scored(processed, log_kept, nan, nan.clone())


def _ban_alone(distribution: SamplingDistribution, trainer_temperature: float) -> bool:
    plain = not (distribution.truncates or distribution.biases or distribution.allowed is not None)
    return plain and distribution.temperature == trainer_temperature


def _chunks(count: int, width: int) -> list[slice]:
    """``count`` positions in chunks of at most ``CHUNK_ELEMENTS`` elements, ``width`` of them made per position: the
    vocabulary for the cuts and the full rows; for the ban alone, far fewer (so thousands of positions per chunk)."""
    rows = max(1, CHUNK_ELEMENTS // width)
    return [slice(start, min(start + rows, count)) for start in range(0, count, rows)]


def _ban(positions: Positions, index: slice, ids: torch.Tensor, distribution: SamplingDistribution) -> Scored:
    """The ban alone at TRL's temperature, from gathers: the sampled token's logit and the banned tokens' (no
    [positions x vocabulary] tensor, so thousands of positions per chunk: few kernel launches and host syncs on a
    GPU); full logits only for a position whose banned share may be most of the mass, a chunk of them at a time."""
    temperature = distribution.temperature
    sampled = positions.sampled(index, ids) / temperature
    nan = torch.full_like(sampled, math.nan)
    if not distribution.banned:
        return Scored(nan, nan.clone(), sampled, torch.full_like(sampled, -math.inf))
    banned_ids = torch.tensor(distribution.banned, device=ids.device)
    banned = positions.columns(index, banned_ids) / temperature
    banned.masked_fill_(banned_ids.unsqueeze(0) == ids.unsqueeze(1), -math.inf)  # the sampled token is kept
    banned_lse = torch.logsumexp(banned, dim=-1)
    # the true normaliser is at least logaddexp(sampled, banned): a bound on the banned share, from gathers alone
    share_bound = torch.exp(banned_lse - torch.logaddexp(sampled, banned_lse))
    processed, log_kept = nan, nan.clone()
    dominant = (share_bound > DOMINANT_SHARE).nonzero().squeeze(1)
    for part in _chunks(dominant.numel(), positions.layer.vocabulary):
        chosen = dominant[part]
        exact = _processed_general(positions.rows(chosen + (index.start or 0)), ids[chosen], distribution)
        processed[chosen], log_kept[chosen] = exact
    return Scored(processed, log_kept, sampled, banned_lse)


def _cuts(
    positions: Positions, index: slice, ids: torch.Tensor, distribution: SamplingDistribution
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bans and the three cuts without a sort or a copy of the logits: the kept tokens are found among the largest
    (``torch.topk``), the normaliser of the full distribution is one logsumexp. A row whose kept set reaches beyond
    the candidates goes through ``_processed_general``."""
    raw = positions.view(index)
    temperature = distribution.temperature
    plain_lse = _logsumexp_float(raw, temperature)
    sampled = raw.gather(1, ids.unsqueeze(1)).squeeze(1).to(torch.float32) / temperature
    banned = torch.tensor(distribution.banned, dtype=torch.long, device=ids.device)
    count = min(raw.size(1), max(TOP_P_CANDIDATES[0], distribution.top_k) + banned.numel())
    values, tokens = torch.topk(raw, count, dim=-1)
    values = values.to(torch.float32) / temperature
    if banned.numel():
        values.masked_fill_(torch.isin(tokens, banned), -math.inf)
        values = values.sort(dim=-1, descending=True).values
        banned_values = raw.index_select(1, banned).to(torch.float32) / temperature
        survivors_lse = _log_sub_exp(plain_lse, torch.logsumexp(banned_values, dim=-1))  # all but the banned
    else:
        survivors_lse = plain_lse
    threshold = torch.full((raw.size(0),), -math.inf, dtype=torch.float32, device=raw.device)
    if distribution.min_p > 0:
        threshold = torch.maximum(threshold, values[:, 0] + math.log(distribution.min_p))
    if 0 < distribution.top_k < raw.size(1):
        threshold = torch.maximum(threshold, values[:, distribution.top_k - 1])
    # the tokens above the threshold are all candidates when the last candidate is below it
    inside = values[:, -1] < threshold
    if distribution.top_p < 1.0:
        lse = torch.where(
            inside, torch.logsumexp(values.masked_fill(values < threshold[:, None], -math.inf), -1), survivors_lse
        )
        boundary, resolved = _top_p_boundary(values, threshold[:, None], lse[:, None], distribution.top_p)
        threshold = torch.maximum(threshold, boundary.squeeze(1))
        inside = resolved & (values[:, -1] < threshold)
    kept_values = values.masked_fill(values < threshold[:, None], -math.inf)
    left_out = sampled < threshold  # the sampled token is always kept
    kept_lse = torch.logsumexp(kept_values, dim=-1)
    kept_lse = torch.where(left_out, torch.logaddexp(kept_lse, sampled), kept_lse)
    processed, log_kept = sampled - kept_lse, kept_lse - plain_lse
    outside = (~inside).nonzero().squeeze(1)
    if outside.numel():  # the kept set reaches beyond the candidates: the full computation for those rows
        start = index.start or 0
        processed[outside], log_kept[outside] = _processed_general(
            positions.rows(outside + start), ids[outside], distribution
        )
    return processed, log_kept


def _logsumexp_float(raw: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logsumexp over the vocabulary in float32, a few rows at a time (no float32 copy of a whole chunk)."""
    if raw.dtype == torch.float32 and temperature == 1.0:
        return torch.logsumexp(raw, dim=-1)
    step = max(1, raw.size(0) // 8)
    return torch.cat(
        [
            torch.logsumexp(raw[i : i + step].to(torch.float32) / temperature, dim=-1)
            for i in range(0, raw.size(0), step)
        ]
    )


def _log_sub_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log(exp(a) - exp(b)) for a > b."""
    return a + torch.log1p(-torch.exp(b - a).clamp(max=1.0))


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
        bias = torch.tensor([value for _, value in distribution.biases], dtype=y.dtype, device=y.device)
        bias = bias / distribution.temperature
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
    threshold = torch.full((y.size(0), 1), -math.inf, dtype=y.dtype, device=y.device)
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
    boundary = torch.empty_like(threshold)
    rows = torch.arange(y.size(0), device=y.device)
    for candidates in TOP_P_CANDIDATES:
        count = min(y.size(1), max(candidates, distribution.top_k))
        values = torch.topk(y[rows], count, dim=-1).values  # descending
        found, resolved = _top_p_boundary(values, threshold[rows], survivors_lse[rows], distribution.top_p)
        boundary[rows[resolved]] = found[resolved]
        rows = rows[~resolved]
        if not rows.numel():
            return boundary
    full = torch.sort(y[rows], dim=-1, descending=True).values  # the boundary lies beyond every candidate
    boundary[rows] = _top_p_boundary(full, threshold[rows], survivors_lse[rows], distribution.top_p)[0]
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
