"""What the tests share: facts about the installed TRL, fresh interpreters, and modules made from source text.

- Facts about the installed TRL decide which bugs exist here; they are read from its source, as the fixes do.
- ``run_python`` runs a snippet in a fresh interpreter, so import order and environment switches are tested for real.
  The snippet is written to a file (so ``inspect.getsource`` works on what it defines). ``with_vllm=False`` hides
  vLLM from that interpreter: the patching mechanics do not depend on it and its import costs ~6 s per process.
- ``module_from_source`` imports a modified copy of TRL's code written in a test, and forgets it afterwards.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

# every Qwen vision-language family users train, dense and mixture-of-experts (tiny_model.FAMILIES)
QWEN_FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl"]

# --- the installed TRL ------------------------------------------------------------------------------------------


@functools.cache
def upstream_reloads_from_disk() -> bool:
    """True on TRL 1.9.1 (the reload bug exists); False on TRL >= 1.16, which re-pushes itself (the fix steps aside)."""
    from trl.generation.vllm_generation import VLLMGeneration

    return 'collective_rpc("reload_weights")' in inspect.getsource(VLLMGeneration.generate)


def expected_reload_skip_state() -> str:
    return "applied" if upstream_reloads_from_disk() else "not-needed"


def flashinfer_gdn_prefill_kernel_replaced() -> bool:
    """vLLM >= 0.26.0 pins FlashInfer >= 0.6.14, which no longer has the SM90 C++ GDN prefill kernel reported to
    hang (read from the installed package metadata; a FlashInfer installed beside it decides)."""
    from importlib import metadata

    from packaging.version import Version

    def version(package: str) -> Version | None:
        try:
            return Version(Version(metadata.version(package)).public)
        except metadata.PackageNotFoundError:
            return None

    vllm, flashinfer = version("vllm"), version("flashinfer-python")
    return vllm is not None and vllm >= Version("0.26.0") and (flashinfer is None or flashinfer >= Version("0.6.14"))


def gdn_prefill_acts() -> bool:
    """Does gdn_prefill add its argument to a Gated-DeltaNet engine here (not where the old kernel is gone)?"""
    return not flashinfer_gdn_prefill_kernel_replaced()


def expected_states() -> dict[str, str]:
    """Every fix's state once TRL is imported, with default switches, on this TRL and vLLM: read from each fix's
    declaration (its targets' own upstream checks on the installed code), so a new fix adds nothing here. The tests of
    each fix check its not-needed cases against facts read independently (above)."""
    import importlib

    from trl_vlm_fixes.patches import ALL_FIXES

    states = {}
    for fix in ALL_FIXES:
        needed = []
        for target in fix.targets:
            try:
                module = importlib.import_module(target.module)
            except ImportError:
                continue
            owner_name, _, attribute = target.qualname.rpartition(".")
            owner = getattr(module, owner_name, None) if owner_name else module
            function = vars(owner).get(attribute) if owner is not None else None
            if function is not None:
                needed.append(target.upstream_fixed(getattr(function, "__wrapped__", function)) is None)
        states[fix.name] = "applied" if any(needed) else "not-needed"
    return states


@functools.cache
def upstream_suppresses_image_token() -> bool:
    """TRL >= 1.16 suppresses the image pad token in its transformers generate path itself (only that token)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    return "suppress_tokens" in inspect.getsource(GRPOTrainer.__init__)


@functools.cache
def server_engine_build_problem_in_llm_worker() -> bool:
    """TRL 1.9.1's `trl vllm-serve` builds its engine in `llm_worker`, where the engine fixes reach it."""
    import trl.scripts.vllm_serve as vllm_serve

    return hasattr(vllm_serve, "llm_worker")


# --- two CPU ranks ---------------------------------------------------------------------------------------------


def accelerate_two_cpu_ranks(port: str) -> list[str]:
    """``accelerate launch`` with two processes on this machine (gloo), before the program and its arguments."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    return [
        *launch,
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        port,
    ]


# --- TRL's server client, stood in -------------------------------------------------------------------------


class ServerClientStub:
    """TRL's ``VLLMClient`` without a server: the weight pushes and cache resets TRL makes are accepted; a test
    subclass writes ``generate`` (what `trl vllm-serve` answers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def init_communicator(self, device: Any = 0) -> None:
        pass

    def update_named_param(self, name: str, weights: Any) -> None:
        pass

    def update_named_params(self, metadata: Any, params: Any) -> None:  # TRL >= 1.16 pushes in one call
        for _ in params:
            pass

    def reset_prefix_cache(self) -> None:
        pass


class StandInServer(ServerClientStub):
    """`trl vllm-serve` answering from the engine stand-in (vLLM's own Sampler): the request crosses JSON as TRL's
    client sends it, and the server builds ``SamplingParams`` as TRL 1.9.1's ``vllm_serve.py`` does (its fields, then
    the request's ``generation_kwargs`` over them) for an engine built with ``logprobs_mode="processed_logprobs"``.
    Text prompts only. The weights TRL pushes are dropped: a test reads the first step, where both sides hold the
    checkpoint. ``requests`` keeps every request as the server received it."""

    model_dir = ""
    requests: list[dict[str, Any]] = []
    _engine: Any = None

    def get_server_info(self) -> dict[str, Any]:  # TRL >= 1.16 checks the server's logprobs mode
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def generate(self, prompts: list[list[int]], n: int = 1, **fields: Any) -> dict[str, Any]:
        from vllm import SamplingParams

        from trl_vlm_fixes.selftest.engine_standin import StandInLLM

        names = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs")
        body = {"prompts": prompts, "n": n, **{k: fields[k] for k in names if k in fields}}
        request = json.loads(json.dumps({**body, "generation_kwargs": fields.get("generation_kwargs") or {}}))
        type(self).requests.append(request)
        settings = {"n": request["n"], **{k: request[k] for k in names if k in request}}
        settings.update(request["generation_kwargs"])
        if type(self)._engine is None:
            type(self)._engine = StandInLLM(self.model_dir, logprobs_mode="processed_logprobs")
        outputs = type(self)._engine.generate(
            [{"prompt_token_ids": ids} for ids in request["prompts"]], SamplingParams(**settings)
        )
        completions = [completion for output in outputs for completion in output.outputs]
        return {
            "prompt_ids": [output.prompt_token_ids for output in outputs],
            "completion_ids": [completion.token_ids for completion in completions],
            "logprobs": [[[lp.logprob for lp in token.values()] for token in c.logprobs] for c in completions],
            "logprob_token_ids": [[list(token) for token in c.logprobs] for c in completions],
        }


# --- fresh interpreters ----------------------------------------------------------------------------------------

PRELUDE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
"""
HIDE_VLLM = "sys.modules['vllm'] = None\n"


def environment_without_switches() -> dict[str, str]:
    """This process's environment minus every TRL_VLM_FIXES* switch: a child starts from the defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TRL_VLM_FIXES")}


def run_python(
    code: str = "", env: dict[str, str] | None = None, args: list[str] | None = None, with_vllm: bool = False
) -> subprocess.CompletedProcess:
    environment = {**environment_without_switches(), **(env or {})}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(PRELUDE + ("" if with_vllm else HIDE_VLLM) + textwrap.dedent(code))
    command = [sys.executable, *(args or [script.name])]
    try:
        return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(script.name)


def without_version_drift(stderr: str) -> list[str]:
    """The lines of a child's stderr, less the plugin's warnings that the installed TRL/vLLM are not the validated
    ones (expected on every other stack CI tests)."""
    return [line for line in stderr.splitlines() if " was validated on other versions than installed: " not in line]


def last_json(result: subprocess.CompletedProcess) -> Any:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- modules from source text ----------------------------------------------------------------------------------


@contextmanager
def module_from_source(directory: Path, name: str, source: str) -> Iterator[ModuleType]:
    path = directory / f"{name}.py"
    path.write_text(source)  # a real file, so inspect.getsource (and the AST guards) can read it
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def _declared_counters() -> Any:
    """Every fix's declared counter, by its metric name in capitals (``counters.MM_REALIGNED_ROWS``)."""
    from types import SimpleNamespace

    from trl_vlm_fixes.patches import ALL_FIXES

    return SimpleNamespace(
        **{c.name.removeprefix("trl_vlm_fixes/").upper(): c for fix in ALL_FIXES for c in fix.counters}
    )


counters = _declared_counters()
