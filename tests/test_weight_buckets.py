"""weight_buckets: TRL's colocated weight push into vLLM's real model classes (CPU), a bucket at a time.

vLLM's own model class of every Qwen family, built on the CPU by vLLM's loader (``selftest/vllm_model``: experts on
Triton, as vLLM picks on Hopper), is the engine TRL's real ``VLLMGeneration`` pushes into. Every engine parameter is
NaN before each push (a parameter a push never reaches cannot pass), and after it is compared bit for bit (float32)
with the engine after TRL's own per-parameter push (the fix off). Spies count ``load_weights`` calls and
``gather_params`` calls per push. Bucket sizes from one parameter per bucket to the whole model in one call cut the
stacked groups vLLM fuses (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, Gated-DeltaNet's ``in_proj_*``)
across buckets. A simulated DeepSpeed ZeRO-3 (parameters empty outside their gather) shows every tensor read inside its
bucket's gather. With sleep mode, vLLM's class is TRL's colocated engine with level-2 wakes that hand out NaN pages
(``selftest/vllm_engine``) and reload_skip and wake_reset on, driven as the trainer drives it.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import QWEN_FAMILIES

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

import trl_vlm_fixes  # noqa: E402
from trl_vlm_fixes.patches import weight_buckets  # noqa: E402
from trl_vlm_fixes.patches.weight_buckets import MIB, aside_reason, buckets, shape_problem  # noqa: E402
from trl_vlm_fixes.selftest.checks.weight_buckets import (  # noqa: E402
    CountingEngine,
    Pushed,
    PushSetup,
    push_setup,
    trained_model,
)

# vLLM's world of one rank built for a MoE model serves dense models too, not the other way round: MoE first
BUILD_ORDER = ("qwen3_5_moe", "qwen3_vl_moe", "qwen3_5", "qwen3_vl", "qwen2_5_vl")
BUCKET_VARIABLE = "TRL_VLM_FIXES_WEIGHT_BUCKET_MB"
# bucket limits in bytes: one parameter per bucket, then buckets that cut the tiny models' groups at many places
SPLITS = (1, 512, 2048, 4096, 8192, 32768)
# names that vLLM stacks into one parameter (the part that differs between the members of one group)
STACKED = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a)\.")


def per_parameter_loop_upstream() -> bool:
    """TRL 1.9.1's sync_weights has the per-parameter loop the fix replays; TRL >= 1.16 streams
    ``_iter_named_params`` (the fix steps aside there)."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    return "_iter_named_params" not in inspect.getsource(VLLMGeneration.sync_weights)


acts_here = pytest.mark.skipif(
    not per_parameter_loop_upstream(),
    reason="TRL >= 1.16: the fix steps aside (test_newer_trl_steps_aside_with_its_reason)",
)


def _skip_where_vllm_transposes_the_experts(model_dir: Path) -> str | None:
    from transformers import AutoConfig

    from trl_vlm_fixes.moe_backend import fused_expert_layout_problem

    return fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir))


@pytest.fixture(scope="module")
def setups(family_model_dir: Callable[[str], Path]) -> Iterator[dict[str, Any]]:
    """For each family: TRL's VLLMGeneration (colocate, no sleep mode) pushing into vLLM's real class (or why not)."""
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.vllm_engine import release
    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable

    release()
    built: dict[str, Any] = {}
    for family in BUILD_ORDER:
        model_dir = family_model_dir(family)
        if problem := _skip_where_vllm_transposes_the_experts(model_dir):
            built[family] = f"{problem} (test_moe_weight_push shows it)"
            continue
        try:
            built[family] = push_setup(model_dir, AutoProcessor.from_pretrained(model_dir))
        except VllmModelUnavailable as error:
            built[family] = f"vLLM's model class cannot be built on this machine: {error}"
    yield built
    release()


def _setup(setups: dict[str, Any], family: str) -> PushSetup:
    setup = setups[family]
    if isinstance(setup, str):
        pytest.skip(setup)
    return setup


def _trl_names(setup: PushSetup) -> list[str]:
    generation = setup.generation
    return [generation._fix_param_name_to_vllm(name) for name, _ in generation.model.named_parameters()]


def _expected_buckets(setup: PushSetup, limit: int) -> list[int]:
    """How many parameters each bucket holds, from the parameters' sizes alone (greedy, in order)."""
    sizes, counts, total = [p.numel() * p.element_size() for p in setup.generation.model.parameters()], [], 0
    for size in sizes:
        if counts and total + size > limit:
            counts.append(0)
            total = 0
        if not counts:
            counts.append(0)
        counts[-1] += 1
        total += size
    return counts


def _split_groups(calls: list[list[str]]) -> set[str]:
    """Stacked groups whose members went to vLLM in different load_weights calls."""
    where: dict[str, set[int]] = {}
    for index, call in enumerate(calls):
        for name in call:
            if STACKED.search(name):
                where.setdefault(STACKED.sub(".*.", name), set()).add(index)
    return {group for group, indices in where.items() if len(indices) > 1}


@acts_here
@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_one_call_and_one_gather_per_bucket_and_the_engine_bit_identical(
    setups: dict[str, Any],
    family: str,
    with_setting: Callable[[str, str], None],
    one_fix_off: Callable[[str], None],
) -> None:
    """Fix on: one load_weights and one gather per bucket, TRL's names in TRL's order, for the default size (the
    whole tiny model in one call) and sizes that cut vLLM's stacked groups across calls. Fix off (TRL 1.9.1): one of
    each per parameter. The engine's every parameter after each push is the per-parameter push's, bit for bit."""
    setup = _setup(setups, family)
    names = _trl_names(setup)
    pushes: dict[str, Pushed] = {"default": setup.push()}
    default = pushes["default"]
    assert [len(call) for call in default.calls] == [len(names)]  # 512 MiB holds the whole tiny model
    assert default.gathers == 1 and setup.engine.prefix_cache_resets >= 1
    split: set[str] = set()
    for limit in SPLITS:
        with_setting(BUCKET_VARIABLE, repr(limit / MIB))
        pushed = pushes[f"{limit} B"] = setup.push()
        assert [len(call) for call in pushed.calls] == _expected_buckets(setup, limit)
        assert [name for call in pushed.calls for name in call] == names
        assert pushed.gathers == len(pushed.calls)
        split |= _split_groups(pushed.calls)
    assert split, "no bucket size cut a stacked group across calls: the sizes test nothing"

    one_fix_off("weight_buckets")
    upstream = setup.push()
    assert upstream.calls == [[name] for name in names]  # TRL 1.9.1: one call per parameter...
    assert upstream.gathers == len(names)  # ... and one gather per parameter
    assert not any(torch.isnan(tensor).any() for tensor in upstream.parameters.values())
    for label, pushed in pushes.items():
        assert pushed.mismatches(upstream) == [], label


class Zero3:
    """DeepSpeed ZeRO-3 as TRL's push sees it: a parameter is empty (``ds_numel`` its full size) outside a
    ``gather_params`` of it, whole inside; the peak of gathered bytes is recorded."""

    is_zero3, is_fsdp, fsdp_version = True, False, None

    def __init__(self, model: Any) -> None:
        self.full = {id(p): p.data for p in model.parameters()}
        for parameter in model.parameters():
            parameter.ds_numel = parameter.numel()
            parameter.data = torch.empty(0, dtype=parameter.dtype)
        self.gathered = 0
        self.peak = 0

    @contextmanager
    def gather_params(self, params: Any) -> Iterator[None]:
        params = list(params)
        for parameter in params:
            parameter.data = self.full[id(parameter)]
        self.gathered += sum(p.numel() * p.element_size() for p in params)
        self.peak = max(self.peak, self.gathered)
        try:
            yield
        finally:
            for parameter in params:
                self.gathered -= parameter.numel() * parameter.element_size()
                parameter.data = torch.empty(0, dtype=parameter.dtype)


@acts_here
def test_under_zero3_every_bucket_is_read_inside_its_gather(
    setups: dict[str, Any],
    family_model_dir: Callable[[str], Path],
    with_setting: Callable[[str, str], None],
    one_fix_off: Callable[[str], None],
) -> None:
    """Simulated ZeRO-3 (parameters empty outside their gather): buckets sized by ``ds_numel``, one gather each,
    gathered bytes at most max(bucket size, largest parameter), the engine exactly as after TRL's per-parameter
    gathers. A tensor read outside its gather would be empty and vLLM's loader would refuse it."""
    setup = _setup(setups, "qwen3_5_moe")
    from trl_vlm_fixes.selftest.checks.weight_buckets import CountingGathers

    model = trained_model(family_model_dir("qwen3_5_moe"), seed=1)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    zero3 = Zero3(model)
    saved = setup.generation.model, setup.gathers
    setup.generation.model, setup.gathers = model, CountingGathers(zero3)
    setup.generation._dist = setup.gathers
    limit = 8192
    try:
        with_setting(BUCKET_VARIABLE, repr(limit / MIB))
        bucketed = setup.push()
        assert 1 < bucketed.gathers == len(bucketed.calls) < len(sizes)
        assert zero3.peak <= max(limit, max(sizes)) and zero3.gathered == 0
        assert all(p.numel() == 0 for p in model.parameters())  # every gather ended
        one_fix_off("weight_buckets")
        upstream = setup.push()
    finally:
        setup.generation.model, setup.gathers = saved
        setup.generation._dist = setup.gathers
    assert upstream.gathers == len(upstream.calls) == len(sizes)
    assert bucketed.mismatches(upstream) == []
    assert not any(torch.isnan(tensor).any() for tensor in upstream.parameters.values())


# --- sleep mode, reload_skip and wake_reset on: vLLM's class as TRL's colocated engine, NaN pages on every wake ---


def _engine_run(model_dir: Path, processor: Any) -> SimpleNamespace:
    """TRL's real VLLMGeneration with sleep mode on vLLM's class (level-2 wakes hand out NaN pages), driven as the
    trainer drives it: a push per step, a second rollout in the same step (reload_skip re-pushes through
    sync_weights), three steps. The engine's parameters after every push, the logits of every generate, and the
    load_weights calls and gathers of every push."""
    from trl_vlm_fixes.selftest.checks.weight_buckets import CountingGathers
    from trl_vlm_fixes.selftest.rollout_schedule import build_generation
    from trl_vlm_fixes.selftest.vllm_engine import VllmModelLLM

    generation = build_generation(model_dir, processor, engine_class=VllmModelLLM)
    engine: VllmModelLLM = generation.llm
    gathers = CountingGathers(generation._dist)
    generation._dist = gathers
    vllm_model = engine.vllm.model
    run = SimpleNamespace(after_push=[], calls_per_push=[], gathers_per_push=[], logits=[])
    calls: list[int] = []
    load = vllm_model.load_weights

    def counted(weights: Any) -> Any:
        calls.append(1)
        return load(weights)

    def reset_prefix_cache(*args: Any, **kwargs: Any) -> bool:  # TRL's last step of every push
        run.after_push.append({n: t.detach().clone() for n, t in vllm_model.named_parameters()})
        run.calls_per_push.append(len(calls))
        run.gathers_per_push.append(len(gathers.calls))
        calls.clear()
        gathers.calls.clear()
        return True

    vllm_model.load_weights = counted
    engine.reset_prefix_cache = reset_prefix_cache  # type: ignore[method-assign]
    ids = processor.tokenizer.encode("a text prompt for every push")
    generator = torch.Generator().manual_seed(0)
    try:
        for _ in range(3):
            with torch.no_grad():
                for parameter in generation.model.parameters():
                    parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=0.05)
            generation.sync_weights()  # TRL's sync at a new global step
            for _ in range(2):  # the second rollout of the step: reload_skip re-pushes what sleep discarded
                generation.generate(prompts=[ids], images=None, num_generations=1)
    finally:
        del vllm_model.load_weights
    run.logits = [served for served, _ in engine.logits]
    run.parameters = sum(1 for _ in generation.model.parameters())
    return run


@acts_here
@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_with_sleep_mode_reload_skip_and_wake_reset_the_engine_is_the_per_parameter_pushs(
    setups: dict[str, Any],
    family_model_dir: Callable[[str], Path],
    one_fix_off: Callable[[str], None],
    family: str,
) -> None:
    """Every push (TRL's and reload_skip's re-push) after NaN wakes leaves vLLM's parameters bit for bit as TRL's
    per-parameter push does, and every generate computes the same logits (Qwen3-VL-MoE: wake_reset puts its
    deepstack rows back; both: experts). Fix on: one load_weights and one gather per push; off: one per parameter."""
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable

    _setup(setups, family)  # skips where vLLM takes no push of this family here
    model_dir = family_model_dir(family)
    processor = AutoProcessor.from_pretrained(model_dir)
    try:
        bucketed = _engine_run(model_dir, processor)
        one_fix_off("weight_buckets")
        upstream = _engine_run(model_dir, processor)
    except VllmModelUnavailable as error:
        pytest.skip(f"vLLM's model class cannot be built on this machine: {error}")
    pushes = len(upstream.after_push)
    assert pushes == 6 == len(bucketed.after_push)  # 3 syncs + 3 re-pushes by reload_skip
    assert upstream.calls_per_push == [upstream.parameters] * pushes
    assert upstream.gathers_per_push == [upstream.parameters] * pushes
    assert bucketed.calls_per_push == [1] * pushes and bucketed.gathers_per_push == [1] * pushes
    for ours, theirs in zip(bucketed.after_push, upstream.after_push, strict=True):
        assert not any(torch.isnan(t).any() for t in theirs.values())
        assert [n for n in theirs if not torch.equal(ours[n], theirs[n])] == []
    assert len(bucketed.logits) == len(upstream.logits) == 6
    assert all(torch.equal(a, b) for a, b in zip(bucketed.logits, upstream.logits, strict=True))
    assert not any(torch.isnan(logits).any() for logits in bucketed.logits)


# --- where the fix steps aside: one log line, TRL's own push --------------------------------------------------------


@contextmanager
def _logged(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        yield lines
    lines.extend(r.getMessage() for r in caplog.records if "weight_buckets" in r.getMessage())


def test_the_fix_logs_once_that_it_acts_or_why_it_steps_aside(
    setups: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    setup = _setup(setups, "qwen3_5")
    with _logged(caplog) as lines:
        setup.push()
        setup.push()
    reason = aside_reason(setup.generation)
    assert len(lines) == 1
    if reason is None:
        count = sum(1 for _ in setup.generation.model.parameters())
        assert f"buckets of up to 512 MiB: 1 load_weights calls for {count} parameters" in lines[0]
    else:
        assert f"steps aside: {reason}; TRL's own push runs" in lines[0]


def test_server_mode_is_left_to_trl(setups: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Server mode: TRL's client gets one update per parameter and the prefix-cache reset, as upstream."""
    setup = _setup(setups, "qwen3_5")
    generation = setup.generation
    sent: list[str] = []
    client = SimpleNamespace(
        update_named_param=lambda name, tensor: sent.append(name),
        update_named_params=lambda metadata, named: sent.extend(name for name, _ in named),
        reset_prefix_cache=lambda: sent.append("reset"),
    )
    saved = generation.mode, generation.__dict__.get("vllm_client")
    generation.mode, generation.vllm_client = "server", client
    setup.engine.calls.clear()
    try:
        with _logged(caplog) as lines:
            generation.sync_weights()
    finally:
        generation.mode, generation.vllm_client = saved
    assert sent == [*_trl_names(setup), "reset"]
    assert setup.engine.calls == []
    assert len(lines) == 1 and "server mode" in lines[0]


@acts_here
def test_peft_and_fsdp_are_left_to_trl(
    setups: dict[str, Any], family_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """PEFT: TRL's one gather of the whole model and its per-parameter push of the merged weights. FSDP: TRL's
    own traversal. One log line each."""
    from peft import LoraConfig, get_peft_model

    setup = _setup(setups, "qwen3_5")
    generation = setup.generation
    trainer_model = generation.model
    generation.model = get_peft_model(
        trained_model(family_model_dir("qwen3_5")), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    try:
        with _logged(caplog) as lines:
            pushed = setup.push()
        assert pushed.gathers == 1  # TRL's gather of the whole model, then one call per merged parameter
        assert len(pushed.calls) > 1 and all(len(call) == 1 for call in pushed.calls)
        assert len(lines) == 1 and "PEFT" in lines[0]
    finally:
        generation.model = trainer_model
    fsdp_pushes: list[Any] = []
    fsdp = SimpleNamespace(is_fsdp=True, is_zero3=False, fsdp_version=2, gather_params=setup.gathers.gather_params)
    generation._dist = fsdp
    generation._sync_fsdp_params_to_vllm = fsdp_pushes.append
    try:
        caplog.clear()
        with _logged(caplog) as lines:
            generation.sync_weights()
    finally:
        generation._dist = setup.gathers
        del generation._sync_fsdp_params_to_vllm
    assert fsdp_pushes == [trainer_model]
    assert len(lines) == 1 and "FSDP" in lines[0]


def test_newer_trl_steps_aside_with_its_reason(setups: dict[str, Any]) -> None:
    """On the installed TRL: the fix's verdict on its sync_weights follows from the source, read independently."""
    from trl.generation.vllm_generation import VLLMGeneration

    problem = shape_problem(VLLMGeneration.sync_weights, getattr(VLLMGeneration, "_push_param_to_vllm", None))
    if per_parameter_loop_upstream():
        assert problem is None
        return
    assert problem is not None and "_iter_named_params (TRL >= 1.16)" in problem
    setup = _setup(setups, "qwen3_5")
    pushed = setup.push()
    assert len(pushed.calls) == pushed.trainer_parameters  # TRL's own push
    assert weight_buckets.scope(SimpleNamespace(use_vllm=True, vllm_generation=setup.generation)) == problem


TRL_BODY = weight_buckets.TRL_1_9_1_SYNC_WEIGHTS
WAKE = '        self.llm.wake_up(tags=["weights"])\n'
RESET = '    elif self.mode == "colocate":\n        self.llm.reset_prefix_cache()\n'
LAST_PUSH = "self._push_param_to_vllm(name, param.data)\n    if"
TRL_1_16 = "def sync_weights(self):\n    for name, param in self._iter_named_params():\n        pass\n"
SHAPES = {
    "as-released": ("", "", None),
    "quotes-docstring-comment": (
        'def sync_weights(self):\n    if self.mode == "colocate"',
        "def sync_weights(self):\n    'Doc.'  # a comment\n    if self.mode == 'colocate'",
        None,
    ),
    "line-breaks": (LAST_PUSH, "self._push_param_to_vllm(\n                        name, param.data\n)\n    if", None),
    "no-wake": (WAKE, "", "not TRL 1.9.1's"),
    "no-reset": (RESET, "", "not TRL 1.9.1's"),
    "other-gather": ("gather_params([param])", "gather_params([param, param])", "not TRL 1.9.1's"),
    "a-line-added": (WAKE, WAKE + "        self._llm_weights_sleeping = False\n", "not TRL 1.9.1's"),
    "trl-1.16": (TRL_BODY, TRL_1_16, "TRL >= 1.16"),
}


@pytest.mark.parametrize("case", SHAPES)
def test_the_shape_guard_is_the_ast(tmp_path: Path, case: str) -> None:
    """TRL 1.9.1's sync_weights, modified: quotes, a docstring, comments and line breaks change nothing; a statement
    added, removed or changed makes the fix step aside, naming why."""
    from helpers import module_from_source

    old, new, verdict = SHAPES[case]
    assert old in TRL_BODY
    source = TRL_BODY.replace(old, new, 1) if old else TRL_BODY
    assert (source != TRL_BODY) is bool(old)
    lines = source.strip("\n").splitlines()
    indented = "class VLLMGeneration:\n" + "\n".join("    " + line for line in lines) + "\n"
    with module_from_source(tmp_path, "modified_sync_weights", indented) as module:
        problem = shape_problem(module.VLLMGeneration.sync_weights)
    assert (problem is None) if verdict is None else (verdict in (problem or ""))


def test_buckets_keep_the_order_and_put_a_large_parameter_alone() -> None:
    tensors = [("a", torch.zeros(3)), ("big", torch.zeros(100)), ("b", torch.zeros(2)), ("c", torch.zeros(2))]
    cut = [[name for name, _ in bucket] for bucket in buckets(iter(tensors), limit=4 * 4)]
    assert cut == [["a"], ["big"], ["b", "c"]]
    partitioned = torch.nn.Parameter(torch.empty(0))
    partitioned.ds_numel = 1000  # ZeRO-3: the full size, not the empty local data
    assert [len(b) for b in buckets(iter([("p", partitioned), ("q", torch.zeros(1))]), limit=4000)] == [1, 1]


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "lots"])
def test_a_bad_bucket_size_fails_naming_the_variable(raw: str) -> None:
    from trl_vlm_fixes.switches import SwitchValueError

    with pytest.raises(SwitchValueError, match=BUCKET_VARIABLE):
        weight_buckets.parse_bucket_mb(raw)
    assert weight_buckets.parse_bucket_mb(" 0.5 ") == 0.5


def test_scope_and_applies() -> None:
    from trl_vlm_fixes.declaration import Plan

    assert "use_vllm is off" in (weight_buckets.scope(SimpleNamespace(use_vllm=False)) or "")
    server = SimpleNamespace(use_vllm=True, vllm_generation=SimpleNamespace(mode="server"))
    assert "server mode" in (weight_buckets.scope(server) or "")
    from trl.generation.vllm_generation import VLLMGeneration

    streams = "_iter_named_params" in inspect.getsource(VLLMGeneration.sync_weights)  # TRL >= 1.16: not 1.9.1's loop
    for plan in (Plan({}, "colocate"), Plan({}, "colocate", sleep_mode=True)):
        reason = weight_buckets.applies(plan)
        assert ("_iter_named_params" in reason) if streams else reason is None, reason
    assert "server mode" in (weight_buckets.applies(Plan({}, "server")) or "")
    assert "use_vllm is off" in (weight_buckets.applies(Plan({}, "none")) or "")
    assert trl_vlm_fixes.status()["patches"]["weight_buckets"]["state"] in {"applied", "stepped-aside"}


def test_the_counting_engine_is_the_path_trl_pushes_through() -> None:
    """The spies stand exactly where TRL's colocated push reaches (no call bypasses them)."""
    engine = CountingEngine(SimpleNamespace(load_weights=lambda weights: {name for name, _ in weights}))
    model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    assert model.load_weights([("x", torch.zeros(1))]) == {"x"} and engine.calls == [["x"]]


def test_under_zero3_the_ranks_agree_on_the_bucket_size_or_push_as_trl(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ranks under ZeRO-3 through torch's real key-value store (a ``HashStore``, as the rendezvous store is one):
    the same bucket size on both, the buckets; another size, or a rank that never says (the fix off there), TRL's
    per-parameter push on this rank with one WARNING, since a different number of gathers would hang the others."""
    import torch.distributed as dist

    generation = SimpleNamespace(_dist=SimpleNamespace(is_zero3=True))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(weight_buckets, "RANKS_WAIT_SECONDS", 0.2)
    verdicts = []
    for other in ("same", "other", None):
        store = dist.HashStore()
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda store=store: store)
        if other is not None:
            store.set("trl_vlm_fixes/weight_buckets/rank1", str(4 * MIB if other == "same" else 8 * MIB))
        monkeypatch.setattr(weight_buckets, "_ranks_verdict", [])
        verdicts.append(weight_buckets.ranks_disagree(generation, 4 * MIB))
        assert store.get("trl_vlm_fixes/weight_buckets/rank0").decode() == str(4 * MIB)  # this rank said its size
    assert verdicts[0] is None
    assert "rank 0: 4 MiB, rank 1: 8 MiB" in (verdicts[1] or "") and BUCKET_VARIABLE in (verdicts[1] or "")
    assert "within 0.2 s" in (verdicts[2] or "")
    assert weight_buckets.ranks_disagree(SimpleNamespace(_dist=SimpleNamespace(is_zero3=False)), 1) is None
    # the wrapper: a disagreement runs TRL's own push (the wrapped function), once said
    monkeypatch.setattr(weight_buckets, "aside_reason", lambda instance, wrapped: None)
    pushed: list[str] = []
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        weight_buckets.sync_weights_wrapper(lambda: pushed.append("trl"), generation, (), {})
    assert pushed == ["trl"] and any("TRL's own push runs" in r.getMessage() for r in caplog.records)
