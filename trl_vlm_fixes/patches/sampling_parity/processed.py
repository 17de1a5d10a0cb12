"""Tensor core of sampling_parity: the trainer's log-probability of each sampled token under vLLM's processed
distribution, from the logits of the scoring pass TRL already runs (or the hidden states that give them).

vLLM 0.25.1's ``Sampler`` (``processed_logprobs``) turns a request's logits into the distribution it samples from
with its own functions, in this order: float32; the ``allowed_token_ids`` mask (as ``InputBatch`` builds it);
``apply_bad_words``; the ``LogitBiasLogitsProcessor``; ``Sampler.apply_temperature``; the ``MinPLogitsProcessor``;
top-k/top-p (``vllm_rule.top_k_top_p``: the one function every engine step takes, its Triton kernel on CUDA); a
float32 log-softmax. Where the distribution is cut or biased, the trainer's logits go through those same functions,
driven through the processors' real ``update_state``/``apply`` (``VllmSteps``): the rule is vLLM's by construction
(its ties, its kernel's pivot search), not a re-implementation. The sampled token is always kept: a numerical
difference between trainer and engine can put it just outside the trainer's own cut.

The logits are read a chunk of positions at a time and without gradient, from the model's own where its output layer
ran (TRL 1.9.1) or projected from the hidden states that predict each scored token (TRL 1.16's fused head never
materializes them): one float32 copy of a chunk is the largest tensor. Nothing on this path reads a value back to the
host. A ban alone at TRL's own temperature needs no pass over the cuts: the banned tokens' logits and the sampled
one's are gathered, the normaliser is TRL's own (its log-prob of the sampled token) where TRL computed it in float32,
and the kept share is 1 minus the banned share, a subtraction; only a position where the banned share may be most of
the mass (where that subtraction would lose float32's digits) gets its logits to sum the kept tokens directly (one
``nonzero`` per call of the model).

Every log-prob this module gives is the engine's own arithmetic on the model's logits: a float32 copy, the engine's
temperature step and its own log-softmax (``engine_steps.log_probs``: V1's ``log_softmax``, V2's Triton kernel),
which give the engine's bits. TRL 1.9.1 divides a bf16 model's bf16 logits by the temperature in place and
log-softmaxes them in bf16, so its log-prob carries bf16 rounding (spacing 0.03 around -5), and its float32 branch
subtracts a log-sum-exp; TRL 1.16's fused head folds bf16 tiles of the same logits into an online log-sum-exp. Each
rounds differently from the engine, one-signed over a completion (on an H100, up to 5.6e-4 of a 2,048-token
completion's weight against V1, docs/gpu-results.md section 17). So the plain distribution's log-prob is the fix's
own (``Scorer.own_plain``) wherever TRL's logits are read (TRL 1.9.1), and on TRL 1.16's fused head on either runner
(against V2 its online sum keeps up to 1.04e-4 of the weight at 2,048 tokens): the hidden states are projected again,
a chunk at a time, in the dtype the fused head's tiles had. Only where the output layer is sharded does TRL 1.16's own
log-prob stay (said once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from . import engine_steps
from .distribution import SamplingDistribution

# logits per chunk (256 MiB in float32; 270 positions at Qwen3.5's 248,320 tokens).
CHUNK_ELEMENTS = 1 << 26
DOMINANT_SHARE = 0.5  # above this bound on the banned share, the kept tokens are summed directly


class OutputLayer:
    """The trainer's output projection, applied to chosen hidden states only (the scoring pass's own weights), in the
    dtype the model's own projection runs in (``product_dtype``: TRL 1.16's fused head's tiles and a bf16 model's
    logits are bf16 products, the engine's; ``product_dtype`` decides it, read where the model's forward runs). The
    weight is cast to that dtype once per layer (one scoring pass), not per chunk."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def vocabulary(self) -> int:
        return int(self.weight.size(0))

    def _in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        if dtype not in self._cast:
            bias = None if self.bias is None else self.bias.to(dtype)
            self._cast[dtype] = (self.weight.to(dtype), bias)
        return self._cast[dtype]

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, vocabulary] float32."""
        return self.of(hidden, None, dtype)

    def products(self, hidden: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, vocabulary] in the projection's own dtype (the values the model's logits hold)."""
        return self._project(hidden, None, dtype)

    def of(
        self, hidden: torch.Tensor, token_ids: torch.Tensor | None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """[rows, k] float32: the logits of ``token_ids`` [k] (every token: None) at ``hidden`` [rows, hidden]."""
        if token_ids is None:
            return self.products(hidden, dtype).to(torch.float32)
        return self._project(hidden, token_ids, dtype).to(torch.float32)

    def _project(self, hidden: torch.Tensor, token_ids: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor:
        """[rows, k] in the projection's dtype: the logits of ``token_ids`` (every token: None)."""
        weight, bias = self._in(dtype or product_dtype(hidden))
        if token_ids is not None:
            weight, bias = weight[token_ids], None if bias is None else bias[token_ids]
        logits = hidden.to(weight.dtype) @ weight.T
        return logits if bias is None else logits + bias

    def each(self, hidden: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows] float32: row i's logit of token ``ids[i]``, a product of the same dtype (one dot product a row)."""
        weight, bias = self._in(dtype or product_dtype(hidden))
        logits = (hidden.to(weight.dtype).unsqueeze(1) @ weight[ids].unsqueeze(2)).reshape(-1)
        return (logits if bias is None else logits + bias[ids]).to(torch.float32)


def product_dtype(hidden: torch.Tensor, float32_head: bool = False) -> torch.dtype:
    """The dtype of the model's output projection where it runs now: float32 under TRL's ``cast_lm_head_to_fp32``,
    else autocast's where it is on (read inside the model's forward), else the hidden states'."""
    if float32_head:
        return torch.float32
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class Positions:
    """The logits of the scored positions: read from the model's own where its output layer ran (TRL 1.9.1: a view
    of TRL's [rows, positions, vocabulary] logits, never copied whole; the layer may then be sharded, ``layer``
    None), else projected from the hidden states that predict them (TRL 1.16's fused head), a chunk at a time."""

    def __init__(
        self,
        hidden: torch.Tensor,
        layer: OutputLayer | None,
        logits: torch.Tensor | None = None,
        lengths: list[int] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.hidden = hidden.reshape(-1, hidden.size(-1))
        self.layer = layer
        self.dtype = dtype  # the projection's, read in the model's forward (None: from the hidden states now)
        self.raw = None if logits is None else logits.unsqueeze(0) if logits.dim() == 2 else logits
        # positions per row ([rows, positions, ...] logits or hidden states; one row where they come flat)
        shaped = self.raw if self.raw is not None else hidden
        self.width = int(shaped.size(1)) if shaped.dim() == 3 else len(self)
        # per row, the positions up to the end of its completion (the rest is padding: no plain log-prob made there)
        self.lengths = lengths
        if lengths is not None and len(lengths) * self.width != len(self):
            raise ValueError(f"{len(lengths)} completion lengths for {len(self)} positions of {self.width} a row")
        if self.raw is None and layer is None:
            raise ValueError("positions without logits need the whole output layer")

    def __len__(self) -> int:
        return self.hidden.size(0)

    @property
    def trl_rounds(self) -> bool:
        """TRL's log-prob of these positions carries its logits' rounding: it log-softmaxes them in their own dtype
        (TRL 1.9.1 on a bf16 model). TRL 1.16's fused head (no logits read here) works in float32."""
        return self.raw is not None and self.raw.dtype not in (torch.float32, torch.float64)

    def plain_log_probs(self, temperature: float, ids: torch.Tensor, runner: str) -> torch.Tensor:
        """[rows] each row's float32 log-prob of its token ``ids`` [rows] under the plain distribution at
        ``temperature``, with the engine's own arithmetic, up to each completion's length (NaN after it, where TRL's
        own log-prob stays and the loss masks it away: nothing is projected or read there), from TRL's logits or,
        without them, from the hidden states projected through the output layer a chunk at a time: read by the
        runner's kernel where it is trusted (``engine_steps.read_by_kernel``), else a float32 copy of a chunk at a time
        (``CHUNK_ELEMENTS`` with the log-softmax's output: ``engine_steps.copied_log_probs``)."""
        plain = torch.full((ids.numel(),), math.nan, dtype=torch.float32, device=ids.device)
        lengths = self.row_lengths
        scored = self.scored_index(ids.device)
        if self.raw is None:
            for part in _chunks(scored.numel(), 2 * self.vocabulary):
                index = scored[part]
                products = self._layer().products(self.hidden[index], self.dtype)
                read = engine_steps.read_by_kernel(products, ids[index], temperature, runner)
                if read is None:
                    read = engine_steps.copied_log_probs(products, ids[index], temperature, runner)
                plain[index] = read
            return plain
        read = engine_steps.read_by_kernel(self.raw, ids[scored], temperature, runner, scored)
        if read is not None:
            plain[scored] = read
            return plain
        width = self.width
        for row, length in enumerate(lengths):
            for chunk in _chunks(length, 2 * self.raw.size(-1)):
                chosen = ids[row * width + chunk.start : row * width + chunk.stop]
                read = engine_steps.copied_log_probs(self.raw[row, chunk], chosen, temperature, runner)
                plain[row * width + chunk.start : row * width + chunk.stop] = read
        return plain

    @property
    def row_lengths(self) -> list[int]:
        """Each row's positions up to its completion's end (every position of the row without ``lengths``)."""
        return [self.width] * (len(self) // self.width) if self.lengths is None else self.lengths

    def scored_index(self, device: torch.device) -> torch.Tensor:
        """The flat indices of the positions up to each row's length (all without ``lengths``), from the host's lengths
        (copied to a GPU without waiting for its queue)."""
        width = self.width
        index = torch.cat([torch.arange(row * width, row * width + n) for row, n in enumerate(self.row_lengths)])
        return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index

    def scored(self, device: torch.device) -> torch.Tensor:
        """[rows] True at the positions up to each completion's end (``lengths``; all of them without)."""
        if self.lengths is None:
            return torch.ones(len(self), dtype=torch.bool, device=device)
        ends = torch.tensor(self.lengths, device=device)
        return (torch.arange(self.width, device=device)[None, :] < ends[:, None]).reshape(-1)

    @property
    def vocabulary(self) -> int:
        """Read from the logits where they are there (a sharded output layer's weight is not whole on this rank)."""
        if self.raw is not None:
            return int(self.raw.size(-1))
        return self._layer().vocabulary

    def _layer(self) -> OutputLayer:
        assert self.layer is not None
        return self.layer

    def _one_row(self) -> torch.Tensor:
        """The logits as [positions, vocabulary], a view: only one row of TRL's batch is one view."""
        assert self.raw is not None and self.raw.size(0) == 1, "slices are read from one row's logits"
        return self.raw[0]

    def rows(self, index: slice | torch.Tensor) -> torch.Tensor:
        """[rows, vocabulary] float32, a copy the caller may overwrite."""
        if self.raw is None:
            return self._layer().logits(self.hidden[index], self.dtype)
        if isinstance(index, slice):
            return self._one_row()[index].to(torch.float32, copy=True)
        width = self.raw.size(1)
        return self.raw[index // width, index % width].to(torch.float32)

    def columns(self, index: slice, token_ids: torch.Tensor) -> torch.Tensor:
        """[rows, k] float32: the logits of ``token_ids`` [k] at the rows ``index`` (never a row in full)."""
        if self.raw is not None:
            return self.raw.index_select(2, token_ids).reshape(-1, token_ids.numel())[index].to(torch.float32)
        return self._layer().of(self.hidden[index], token_ids, self.dtype)

    def sampled(self, index: slice, ids: torch.Tensor) -> torch.Tensor:
        """[rows] float32: each row's logit of its own token; ``ids`` are those of the rows ``index``."""
        if self.raw is not None:
            if self.raw.size(0) == 1:
                return self._one_row()[index].gather(1, ids.unsqueeze(1)).squeeze(1).to(torch.float32)
            assert ids.numel() == len(self), "several rows of TRL's logits are read whole"
            return self.raw.gather(2, ids.reshape(*self.raw.shape[:2], 1)).reshape(-1).to(torch.float32)
        return self._layer().each(self.hidden[index], ids, self.dtype)


@dataclass
class Scored:
    """One chunk of scored positions. ``processed`` (the trainer's log-prob of the sampled token under vLLM's
    distribution) and ``log_kept`` (log of the share of the trainer's distribution the settings keep, at the sampling
    temperature) are NaN where they follow from the plain distribution's log-prob (``finish``): the ban's subtraction,
    or nothing cut. That log-prob is the fix's float32 one, or NaN where it is TRL's own (TRL computed it in float32
    at the sampling temperature)."""

    processed: torch.Tensor
    log_kept: torch.Tensor
    sampled_logit: torch.Tensor  # the sampled token's logit at the sampling temperature
    banned_lse: torch.Tensor  # logsumexp of the banned tokens' logits but the sampled one, at the sampling temperature
    plain: torch.Tensor  # float32 log-prob of the sampled token under the plain distribution, or NaN: TRL's own
    kept_lse: torch.Tensor  # the cut's kept log-sum-exp where its log_kept waits for TRL's normaliser, else NaN

    @classmethod
    def pending(cls, sampled_logit: torch.Tensor, plain: torch.Tensor | None = None) -> Scored:
        """Positions whose processed log-prob is the plain distribution's (nothing banned or cut)."""
        nan = torch.full_like(sampled_logit, math.nan)
        no_ban = torch.full_like(sampled_logit, -math.inf)
        return cls(nan, nan, sampled_logit, no_ban, nan if plain is None else plain, nan)

    def padded(self, rows: int) -> Scored:
        """These positions followed by unscored ones up to ``rows`` (after the sequence ended): TRL's own log-prob
        there, nothing kept or cut."""
        missing = rows - self.processed.numel()
        if missing == 0:
            return self
        tail = Scored.pending(self.processed.new_full((missing,), math.nan))
        return Scored(*(torch.cat(pair) for pair in zip(_fields(self), _fields(tail), strict=True)))

    def at(self, index: torch.Tensor, rows: int) -> Scored:
        """These positions placed at ``index`` among ``rows``; the others unscored (after a completion ended): TRL's
        own log-prob there, nothing kept or cut."""
        fields = _fields(Scored.pending(self.processed.new_full((rows,), math.nan)))
        placed = [field.clone() for field in fields]  # (``pending`` shares one NaN tensor between fields)
        for target, values in zip(placed, _fields(self), strict=True):
            target[index] = values
        return Scored(*placed)

    def finish(self, trl_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, log_kept) [rows]: TRL's log-prob + shift = the processed log-prob."""
        trl = trl_logps.to(torch.float32).reshape(-1)
        full = torch.where(torch.isnan(self.plain), trl, self.plain)  # the plain distribution's log-prob
        lse = self.sampled_logit - full
        banned = self.banned_lse > -math.inf
        share = torch.exp(torch.where(banned, self.banned_lse - lse, -math.inf)).clamp(max=1.0)
        log_kept_ban = torch.log1p(-share)
        pending = torch.isnan(self.processed)
        processed = torch.where(pending, full - log_kept_ban, self.processed)
        waiting = ~torch.isnan(self.kept_lse)
        log_kept = torch.where(pending, log_kept_ban, torch.where(waiting, self.kept_lse - lse, self.log_kept))
        return processed - trl, log_kept


class VllmSteps:
    """vLLM 0.25.1's sampler steps for ``rows`` requests sampled with one distribution, built from vLLM's own classes
    as the engine's ``InputBatch`` builds them (one ``SamplingParams`` added to each row through a
    ``BatchUpdateBuilder``), and applied in the ``Sampler``'s order."""

    def __init__(self, distribution: SamplingDistribution, rows: int, vocabulary: int, device: torch.device) -> None:
        from vllm import SamplingParams
        from vllm.utils import torch_utils
        from vllm.v1.sample.logits_processor import BatchUpdateBuilder
        from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

        self.distribution = distribution
        bias = {token: -math.inf for token in distribution.banned if token not in distribution.bad_word_ids}
        bias.update(dict(distribution.biases))
        params = SamplingParams(
            temperature=distribution.temperature,
            top_k=distribution.top_k,
            top_p=distribution.top_p,
            min_p=distribution.min_p,
            logit_bias=bias or None,
            allowed_token_ids=list(distribution.allowed) if distribution.allowed is not None else None,
        )
        if not torch.cuda.is_available():  # vLLM's platform guess claims pinned memory, which needs a CUDA driver
            torch_utils.PIN_MEMORY = False
        config: Any = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows))
        self.processors = [  # the Sampler's order: non-argmax-invariant (logit_bias), then min_p after temperature
            LogitBiasLogitsProcessor(config, device, False),
            MinPLogitsProcessor(config, device, False),
        ]
        builder = BatchUpdateBuilder()
        builder.added.extend((row, params, [], []) for row in range(rows))
        batch_update = builder.get_and_reset(rows)
        for processor in self.processors:
            processor.update_state(batch_update)
        self.disallowed: torch.Tensor | None = None
        if distribution.allowed is not None:  # InputBatch: True (filled with -inf) but at the allowed ids
            self.disallowed = torch.ones(1, vocabulary, dtype=torch.bool, device=device)
            self.disallowed[0, list(distribution.allowed)] = False
        self.bad_words = [[token] for token in distribution.bad_word_ids]
        self.temperature = torch.full((rows,), distribution.temperature, dtype=torch.float32, device=device)
        # InputBatch: k=None unless some request has 0 < top_k < vocabulary, p=None unless some has top_p < 1
        top_k = distribution.top_k if 0 < distribution.top_k < vocabulary else 0
        self.k = torch.full((rows,), top_k, dtype=torch.int32, device=device) if top_k else None
        top_p = distribution.top_p
        self.p = torch.full((rows,), top_p, dtype=torch.float32, device=device) if top_p < 1 else None
        bias_ids = [token for token, _ in distribution.biases]
        self.bias_ids = torch.tensor(bias_ids, dtype=torch.long, device=device)
        self.bias_values = torch.tensor([value for _, value in distribution.biases], device=device)

    def processed(self, logits: torch.Tensor, ids: torch.Tensor, own_normaliser: bool = True) -> Scored:
        """The processed log-prob of each row's token ``ids`` and the log of the share of the plain distribution at
        the sampling temperature that survives, from float32 ``logits`` [rows, vocabulary], which this overwrites.
        ``own_normaliser=False``: the plain distribution's normaliser is TRL's own (float32, at this temperature), so
        the share waits for it (``Scored.finish``) and no log-sum-exp over the vocabulary is spent on a metric."""
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        from .vllm_rule import top_k_top_p

        bias, min_p = self.processors
        ids = ids.unsqueeze(1)
        temperature = self.distribution.temperature
        raw_sampled = self._at_temperature(logits.gather(1, ids))
        plain_lse = _logsumexp_scaled(logits, temperature) if own_normaliser else None
        if self.disallowed is not None:
            logits.masked_fill_(self.disallowed, -math.inf)
        if self.bad_words:  # one-token words ban a column: vLLM's own function on the transposed rows, all at once
            apply_bad_words(logits.T.unsqueeze(0), {0: self.bad_words}, [[]])
        logits = bias.apply(logits)
        logits = self._at_temperature(logits)
        before_cut = logits.gather(1, ids)
        distribution = self.distribution
        if distribution.logit_min_p:
            logits = engine_steps.logit_min_p(logits, distribution.min_p, distribution.runner)
        else:
            logits = min_p.apply(logits)
        logits = top_k_top_p(logits, self.k, self.p)
        # the sampled token is always kept, at its value before the cuts (before the bans too, if they took it)
        after = logits.gather(1, ids)
        restored = torch.where(before_cut == -math.inf, raw_sampled, before_cut)
        logits.scatter_(1, ids, torch.where(after == -math.inf, restored, after))
        sampled = logits.gather(1, ids).squeeze(1)
        processed = engine_steps.log_probs(logits, ids.squeeze(1), distribution.runner)  # the engine's log-softmax
        kept_lse = sampled - processed
        if self.bias_ids.numel():  # the kept share is of the distribution without biases: take them off the kept
            biased = logits.index_select(1, self.bias_ids) - kept_lse[:, None]
            unbiased = biased - self.bias_values / temperature
            remainder = 1 - torch.exp(biased).sum(-1) + torch.exp(unbiased).sum(-1)
            kept_lse = kept_lse + torch.log(remainder.clamp(min=1e-30))
        nan = torch.full_like(processed, math.nan)
        no_ban = torch.full_like(processed, -math.inf)
        sampled_logit = raw_sampled.squeeze(1)
        if plain_lse is None:
            return Scored(processed, nan, sampled_logit, no_ban, nan, kept_lse)
        return Scored(processed, kept_lse - plain_lse, sampled_logit, no_ban, nan, nan)

    def _at_temperature(self, logits: torch.Tensor) -> torch.Tensor:
        """The engine's temperature step on ``logits`` [rows, ...] in place; at temperature 1 nothing (the division
        changes no bit, and V2's kernel skips it): no pass over the vocabulary."""
        if self.distribution.temperature == 1.0:
            return logits
        return engine_steps.apply(logits, self.temperature[: logits.size(0)], self.distribution.runner)


def _logsumexp_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(logits / temperature) over the vocabulary, without a scaled copy where temperature is 1."""
    if temperature == 1.0:
        return torch.logsumexp(logits, dim=-1)
    return torch.logsumexp(logits / temperature, dim=-1)


class Scorer:
    """One scoring pass's state: the distribution, TRL's temperature, and vLLM's sampler steps per chunk size."""

    def __init__(self, distribution: SamplingDistribution, trainer_temperature: float) -> None:
        self.distribution = distribution
        self.trainer_temperature = trainer_temperature
        self._steps: dict[tuple[int, int, torch.device], VllmSteps] = {}

    @property
    def same_temperature(self) -> bool:
        """TRL scores at the sampling temperature: its normaliser is that of the plain sampling distribution."""
        return self.distribution.temperature == self.trainer_temperature

    @property
    def nothing_to_cut(self) -> bool:
        """vLLM samples the plain distribution at TRL's temperature: only the normaliser's precision is at stake."""
        return self.ban_alone and not self.distribution.banned

    @property
    def ban_alone(self) -> bool:
        """A ban (or nothing) at TRL's own temperature: a normaliser and a subtraction, no pass over the cuts."""
        distribution = self.distribution
        plain = not (distribution.truncates or distribution.biases or distribution.allowed is not None)
        return plain and self.same_temperature

    def own_plain(self, positions: Positions) -> bool:
        """The plain distribution's log-prob is the fix's, the engine's arithmetic: wherever TRL's logits are read
        (TRL 1.9.1: its bf16 or float32 log-softmax is not the engine's), and on TRL 1.16's fused head wherever the
        whole output layer is here to project the hidden states again (TRL's online log-sum-exp is neither V1's
        float32 sum, a one-signed 1-3e-7 nats per token away on an H100, nor V2's within 1e-4 of a 2,048-token
        weight)."""
        return positions.raw is not None or positions.layer is not None

    def steps(self, rows: int, vocabulary: int, device: torch.device) -> VllmSteps:
        key = (rows, vocabulary, device)
        if key not in self._steps:
            self._steps[key] = VllmSteps(self.distribution, rows, vocabulary, device)
        return self._steps[key]

    @torch.no_grad()
    def score(self, positions: Positions, token_ids: torch.Tensor) -> Scored:
        """For the scored positions and their sampled ids [...]: one ``Scored`` over all of them."""
        ids = token_ids.reshape(-1).to(device=positions.hidden.device, dtype=torch.long)
        if len(positions) == 0:  # a completion that ended before its first scored position
            return Scored.pending(torch.full((0,), math.nan, device=ids.device))
        if self.ban_alone:
            if not self.distribution.banned and not self.own_plain(positions):  # TRL 1.16 on V2: TRL's own
                return Scored.pending(torch.full((len(positions),), math.nan, device=ids.device))
            # per position: the banned logits, and three float32 rows of the hidden size (``Positions.sampled``)
            width = len(self.distribution.banned) + 3 * positions.hidden.size(-1)
            whole = positions.raw is not None  # gathers from TRL's logits: nothing of the hidden size is made
            return self._ban(positions, ids, [slice(0, len(positions))] if whole else _chunks(len(positions), width))
        own_normaliser = positions.trl_rounds or not self.same_temperature
        # TRL 1.16's fused head: only the positions up to each completion's end are projected and cut (none of the
        # padding, where TRL's own log-prob stays); TRL 1.9.1's rows come one completion at a time, up to its end
        scored = None if positions.lengths is None else positions.scored_index(ids.device)
        parts = []
        for part in _chunks(len(positions) if scored is None else scored.numel(), positions.vocabulary):
            index = part if scored is None else scored[part]
            logits = positions.rows(index)
            steps = self.steps(logits.size(0), logits.size(1), logits.device)
            parts.append(steps.processed(logits, ids[index], own_normaliser))
        joined = Scored(*(torch.cat(values) for values in zip(*(_fields(part) for part in parts), strict=True)))
        return joined if scored is None else joined.at(scored, len(positions))

    def _ban(self, positions: Positions, ids: torch.Tensor, chunks: list[slice]) -> Scored:
        """The ban alone (or nothing) at TRL's temperature, from gathers: the sampled token's logit and the banned
        tokens' (no [positions x vocabulary] tensor, so thousands of positions per chunk); the float32 normaliser
        where TRL's rounds; full logits only for the positions whose banned share may be most of the mass, found with
        one ``nonzero`` over all of them."""
        distribution = self.distribution
        temperature = distribution.temperature
        plain = positions.plain_log_probs(temperature, ids, distribution.runner) if self.own_plain(positions) else None
        if not distribution.banned:  # the sampled logit only weighs the banned share
            return Scored.pending(torch.full((len(positions),), math.nan, device=ids.device), plain)
        sampled = torch.cat([positions.sampled(index, ids[index]) for index in chunks]) / temperature
        nan = torch.full_like(sampled, math.nan)
        banned_ids = torch.tensor(distribution.banned, device=ids.device)
        banned = torch.cat([positions.columns(index, banned_ids) for index in chunks]) / temperature
        banned.masked_fill_(banned_ids.unsqueeze(0) == ids.unsqueeze(1), -math.inf)  # the sampled token is kept
        banned_lse = torch.logsumexp(banned, dim=-1)
        # the true normaliser is at least logaddexp(sampled, banned): a bound on the banned share, from gathers alone
        share_bound = torch.exp(banned_lse - torch.logaddexp(sampled, banned_lse))
        processed, log_kept = nan.clone(), nan.clone()
        dominant = ((share_bound > DOMINANT_SHARE) & positions.scored(share_bound.device)).nonzero().squeeze(1)
        for part in _chunks(dominant.numel(), positions.vocabulary):
            chosen = dominant[part]
            logits = positions.rows(chosen)
            exact = self.steps(logits.size(0), logits.size(1), logits.device).processed(logits, ids[chosen])
            processed[chosen], log_kept[chosen] = exact.processed, exact.log_kept
        return Scored(processed, log_kept, sampled, banned_lse, nan if plain is None else plain, nan)


def score(
    positions: Positions, token_ids: torch.Tensor, distribution: SamplingDistribution, trainer_temperature: float
) -> Scored:
    """One scoring of ``positions`` (a ``Scorer`` of its own: tests and benchmarks)."""
    return Scorer(distribution, trainer_temperature).score(positions, token_ids)


def _fields(scored: Scored) -> tuple[torch.Tensor, ...]:
    return (
        scored.processed,
        scored.log_kept,
        scored.sampled_logit,
        scored.banned_lse,
        scored.plain,
        scored.kept_lse,
    )


def _chunks(count: int, width: int) -> list[slice]:
    """``count`` positions in chunks of at most ``CHUNK_ELEMENTS`` elements, ``width`` of them made per position: the
    vocabulary for the cuts and the full rows; for the ban alone, far fewer (so thousands of positions per chunk)."""
    rows = max(1, CHUNK_ELEMENTS // width)
    return [slice(start, min(start + rows, count)) for start in range(0, count, rows)]
