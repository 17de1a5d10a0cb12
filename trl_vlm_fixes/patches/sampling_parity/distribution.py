"""The distribution vLLM samples from, read from the settings TRL sends it, in the terms of vLLM 0.25.1's sampler.

TRL builds ``SamplingParams`` from its own fields updated by ``generation_kwargs`` (colocate, ``trl vllm-serve`` and
TRL 1.16's client alike). vLLM's ``Sampler`` then applies, in order: ``allowed_token_ids``, ``bad_words``, the
``min_tokens`` and ``logit_bias`` processors, the penalties, the temperature, ``min_p``, top-k, top-p
(``vllm/v1/sample/sampler.py``). With ``logprobs_mode="processed_logprobs"`` the log-probability it returns is that
of the sampled token in the result, renormalised over the tokens that survive. This module turns the settings into
what the trainer needs to apply the same steps to its own logits: the banned ids, the finite biases, the allowed
ids, the temperature and the truncation. A setting whose effect depends on what was generated so far (penalties,
``min_tokens``, a bad word of several tokens, structured outputs, custom logits processors) is not modelled: the fix
then steps aside for that rollout and says which setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

_SAMPLING_EPS = 1e-5  # vLLM: below this temperature a request is greedy
# the engine's sampler (``SamplingDistribution.runner``): vLLM's V1 sampler, or its V2 model runner's kernels
V1_RUNNER = "v1"
V2_RUNNER = "v2"
# SamplingParams fields that do not change which token is sampled or its processed log-probability
_NEUTRAL = frozenset(
    {
        "n",
        "best_of",
        "seed",
        "max_tokens",
        "logprobs",
        "prompt_logprobs",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "output_kind",
        "truncate_prompt_tokens",
        "extra_args",
        "skip_clone",
    }
)
_MODELLED = frozenset({"temperature", "top_p", "top_k", "min_p", "logit_bias", "bad_words", "allowed_token_ids"})
# neutral at their default value, checked one by one below
_UNMODELLED_WHEN_SET = frozenset(
    {
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "structured_outputs",
        "logits_processors",
        "thinking_token_budget",
        "repetition_detection",
    }
)


@dataclass(frozen=True)
class SamplingDistribution:
    """What vLLM applies to the logits before it samples, as the trainer must apply it to its own."""

    temperature: float
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    banned: tuple[int, ...] = ()  # a -inf logit_bias or a one-token bad word
    bad_word_ids: tuple[int, ...] = ()  # the one-token bad words among them (vLLM bans them with apply_bad_words)
    biases: tuple[tuple[int, float], ...] = ()  # finite logit_bias, added before the temperature
    allowed: tuple[int, ...] | None = None  # allowed_token_ids: every other token is banned
    # the engine's sampler: V1's functions, or the V2 runner's kernels (its min-p rule, logit < max logit +
    # log(min_p), not V1's prob < min_p * max prob; its temperature kernel, not IEEE division on CUDA)
    runner: str = V1_RUNNER

    @property
    def logit_min_p(self) -> bool:
        """min-p by the V2 runner's rule (the two rules differ at the boundary token)."""
        return self.min_p > 0.0 and self.runner == V2_RUNNER

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def changes_anything(self) -> bool:
        return self.truncates or bool(self.banned or self.biases) or self.allowed is not None

    def describe(self) -> str:
        parts = [f"temperature={self.temperature:g}"]
        if self.banned:
            parts.append(f"{len(self.banned)} banned token{'s' if len(self.banned) != 1 else ''}")
        if self.biases:
            parts.append(f"{len(self.biases)} logit biases")
        if self.allowed is not None:
            parts.append(f"{len(self.allowed)} allowed tokens")
        parts += [f"{name}={value:g}" for name, value, off in self._truncation() if value != off]
        if self.runner == V2_RUNNER:
            parts.append("the V2 runner's kernels")
        return ", ".join(parts)

    def _truncation(self) -> list[tuple[str, float, float]]:
        return [("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0), ("min_p", self.min_p, 0.0)]


def effective_settings(generation: Any) -> dict[str, Any]:
    """The keyword arguments of the ``SamplingParams`` TRL's ``VLLMGeneration.generate`` builds (its fields, then
    ``generation_kwargs`` over them)."""
    settings = {
        "repetition_penalty": getattr(generation, "repetition_penalty", 1.0),
        "temperature": getattr(generation, "temperature", 1.0),
        "top_p": getattr(generation, "top_p", 1.0),
        "top_k": getattr(generation, "top_k", 0),
        "min_p": getattr(generation, "min_p", 0.0),
    }
    if getattr(generation, "structured_outputs_regex", None) is not None:
        settings["structured_outputs"] = generation.structured_outputs_regex
    settings.update(getattr(generation, "generation_kwargs", None) or {})
    return settings


def read_distribution(settings: dict[str, Any], tokenizer: Any) -> SamplingDistribution | str:
    """The distribution of these settings, or why it cannot be modelled (one reason, naming the setting)."""
    if reason := _unmodelled(settings):
        return reason
    temperature = 1.0 if settings.get("temperature") is None else float(settings["temperature"])
    if temperature < _SAMPLING_EPS:
        return f"temperature={temperature:g} samples greedily"
    banned: set[int] = set()
    biases: dict[int, float] = {}
    for token, bias in dict(settings.get("logit_bias") or {}).items():
        if bias == -math.inf:
            banned.add(int(token))
        elif bias != 0:
            biases[int(token)] = float(bias)
    words = list(settings.get("bad_words") or [])
    bad_word_ids: set[int] = set()
    if words:
        sequences = bad_word_token_ids(words, tokenizer)
        if isinstance(sequences, str):
            return sequences
        bad_word_ids.update(sequence[0] for sequence in sequences)
    banned |= bad_word_ids
    allowed = settings.get("allowed_token_ids")
    top_k = int(settings.get("top_k") or 0)
    return SamplingDistribution(
        temperature=temperature,
        top_k=top_k if top_k > 0 else 0,
        top_p=1.0 if settings.get("top_p") is None else float(settings["top_p"]),
        min_p=float(settings.get("min_p") or 0.0),
        banned=tuple(sorted(banned)),
        bad_word_ids=tuple(sorted(bad_word_ids)),
        biases=tuple(sorted((t, b) for t, b in biases.items() if t not in banned)),
        allowed=tuple(sorted({int(t) for t in allowed})) if allowed else None,
    )


def _unmodelled(settings: dict[str, Any]) -> str | None:
    penalties = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))
    for name, off in penalties:
        value = settings.get(name)
        if value is not None and float(value) != off:
            return f"{name}={value} (vLLM's penalties depend on the tokens generated so far)"
    if settings.get("min_tokens"):
        return f"min_tokens={settings['min_tokens']} (vLLM bans the stop tokens until then)"
    for name in ("structured_outputs", "logits_processors", "thinking_token_budget", "repetition_detection"):
        if settings.get(name) is not None:
            return f"{name} is set (vLLM masks tokens by a state the trainer does not have)"
    unknown = sorted(set(settings) - _NEUTRAL - _MODELLED - _UNMODELLED_WHEN_SET)
    if unknown:
        return f"generation_kwargs {unknown} are unknown to sampling_parity"
    return None


def bad_word_token_ids(words: list[str], tokenizer: Any) -> list[list[int]] | str:
    """vLLM's ``SamplingParams.update_from_tokenizer``: each word, and its form after a space when that is another
    token of the same length. Only one-token sequences ban a token everywhere; a longer one bans its last token after
    its prefix (not modelled: the reason is returned instead)."""
    if tokenizer is None or not hasattr(tokenizer, "encode"):
        return "bad_words are set and no tokenizer is at hand to read them"
    sequences: list[list[int]] = []
    longer: list[str] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        forms = [plain] + ([spaced] if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        if any(len(ids) != 1 for ids in forms):
            longer.append(word)
        sequences += forms
    if longer:
        return f"bad_words {longer} are several tokens long (vLLM bans them only after their prefix)"
    return sequences
