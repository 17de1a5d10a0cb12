"""`trl-vlm-fixes run -- COMMAND`: the fixes in every Python process of a command nobody edited (TRL's CLI,
accelerate's ranks, vllm-serve's engine), and the CLI itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import accelerate_two_cpu_ranks, environment_without_switches, without_version_drift

PROBE = (
    "import sys, json, wrapt\n"
    "from trl.trainer.grpo_trainer import GRPOTrainer\n"
    "plugin = sys.modules.get('trl_vlm_fixes')\n"
    "print(json.dumps({'loaded': plugin is not None, 'activation': getattr(plugin, 'ACTIVATION', None),\n"
    "    'wrapped': isinstance(vars(GRPOTrainer)['_get_per_token_logps_and_entropies'], wrapt.FunctionWrapper)}))\n"
)


def launcher() -> list[str]:
    """The installed console script, as a user runs it."""
    script = Path(sys.executable).parent / "trl-vlm-fixes"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trl_vlm_fixes"]


def run(command: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Any = None) -> Any:
    environment = {**environment_without_switches(), "HF_HUB_OFFLINE": "1", **(env or {})}
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def last_json_line(text: str) -> Any:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def test_run_patches_trl_in_the_child_process(tmp_path: Path) -> None:
    launched = run([*launcher(), "run", "--", sys.executable, "-c", PROBE], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert last_json_line(launched.stdout) == {"loaded": True, "activation": "launcher", "wrapped": True}
    plain = run([sys.executable, "-c", PROBE], cwd=tmp_path)
    assert last_json_line(plain.stdout) == {"loaded": False, "activation": None, "wrapped": False}


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_an_existing_sitecustomize_still_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    code = "import os, sys, json; print(json.dumps({'user': os.environ.get('USER_SITECUSTOMIZE_RAN'), 'plugin': "
    code += "'trl_vlm_fixes' in sys.modules}))"
    launched = run([*launcher(), "run", "--", sys.executable, "-c", code], env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert last_json_line(launched.stdout) == {"user": "yes", "plugin": True}


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python of another environment, without the plugin (an `accelerate` from elsewhere first on PATH)."""
    environment = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(environment)], check=True, timeout=120)
    python = environment / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import trl_vlm_fixes"], capture_output=True).returncode != 0
    return python


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_strict_stops_a_python_that_lacks_the_plugin_with_one_line(bare_python: Path, tmp_path: Path) -> None:
    strict = {"TRL_VLM_FIXES_STRICT": "1"}
    launched = run([*launcher(), "run", "--", str(bare_python), "-c", "print('ran')"], env=strict, cwd=tmp_path)
    assert launched.returncode == 1 and launched.stdout == ""
    [line] = without_version_drift(launched.stderr)
    assert line.startswith(f"trl_vlm_fixes: {bare_python} cannot import trl_vlm_fixes: install the plugin there (")
    assert f"{bare_python} -m pip install " in line and f"the Python that has it ({sys.executable})" in line
    assert line.endswith("TRL_VLM_FIXES_STRICT=1: exiting.")
    fine = run([*launcher(), "run", "--", sys.executable, "-c", "print('ran')"], env=strict, cwd=tmp_path)
    assert fine.returncode == 0 and fine.stdout == "ran\n" and without_version_drift(fine.stderr) == []


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_without_strict_one_line_and_the_user_sitecustomize_still_runs(bare_python: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    code = "import os; print(os.environ.get('USER_SITECUSTOMIZE_RAN'))"
    command = [*launcher(), "run", "--", str(bare_python), "-c", code]
    launched = run(command, env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert launched.returncode == 0 and launched.stdout == "yes\n", launched.stderr[-2000:]
    [line] = without_version_drift(launched.stderr)
    assert line.startswith(f"trl_vlm_fixes: {bare_python} cannot import trl_vlm_fixes: install the plugin there (")
    assert line.endswith("Running WITHOUT the fixes (TRL_VLM_FIXES_STRICT=1 stops here).")


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_pythonpath_keeps_every_entry_and_the_bootstrap_once(tmp_path: Path) -> None:
    """An empty entry is the current directory (a reward module beside the config); a symlink to the bootstrap
    folder is the bootstrap folder."""
    from trl_vlm_fixes.launcher import BOOTSTRAP, launch_environment

    job, scripts, first, last = (tmp_path / name for name in ("job", "scripts", "first", "last"))
    for folder in (job, scripts, first, last):
        folder.mkdir()
    (job / "my_rewards.py").write_text("VALUE = 'beside the config'\n")
    (scripts / "probe.py").write_text(  # not in the job's folder, as a console script (`trl`) is not
        "import json, os, sys, my_rewards\nprint(json.dumps({'pythonpath': os.environ['PYTHONPATH'], "
        "'reward': my_rewards.VALUE, 'activation': getattr(sys.modules.get('trl_vlm_fixes'), 'ACTIVATION', None)}))\n"
    )
    (tmp_path / "bootstrap-link").symlink_to(BOOTSTRAP, target_is_directory=True)
    plain_path = os.pathsep.join([str(first), "", str(last)])
    plain = run([sys.executable, str(scripts / "probe.py")], env={"PYTHONPATH": plain_path}, cwd=job)
    assert last_json_line(plain.stdout)["reward"] == "beside the config", plain.stderr[-2000:]
    given = os.pathsep.join([str(first), "", str(tmp_path / "bootstrap-link"), str(last)])
    command = [*launcher(), "run", "--", sys.executable, str(scripts / "probe.py")]
    launched = run(command, env={"PYTHONPATH": given}, cwd=job)
    assert launched.returncode == 0 and "Error in sitecustomize" not in launched.stderr, launched.stderr[-2000:]
    assert last_json_line(launched.stdout) == {
        "pythonpath": os.pathsep.join([str(BOOTSTRAP), str(first), "", str(last)]),
        "reward": "beside the config",
        "activation": "launcher",
    }
    for unset in ({}, {"PYTHONPATH": ""}):  # no entry given: none made up (an empty one would add the directory)
        assert launch_environment(unset)["PYTHONPATH"] == str(BOOTSTRAP)


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_the_bootstrap_under_two_names_is_skipped_before_the_user_sitecustomize(tmp_path: Path) -> None:
    """A process that puts the bootstrap folder on its path again under another name (a symlink) still runs the
    user's `sitecustomize` once, not the bootstrap again."""
    from trl_vlm_fixes.launcher import BOOTSTRAP

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('user sitecustomize')\n")
    (tmp_path / "bootstrap-link").symlink_to(BOOTSTRAP, target_is_directory=True)
    pythonpath = os.pathsep.join([str(tmp_path / "bootstrap-link"), str(BOOTSTRAP), str(site)])
    started = run([sys.executable, "-c", "print('ran')"], env={"PYTHONPATH": pythonpath}, cwd=tmp_path)
    assert started.returncode == 0 and without_version_drift(started.stderr) == [], started.stderr[-2000:]
    assert started.stdout == "user sitecustomize\nran\n"


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_nested_launchers_of_two_installations_run_the_user_sitecustomize_once(tmp_path: Path) -> None:
    """`trl-vlm-fixes run -- script` where the script runs another installation's launcher: both bootstrap folders
    are on PYTHONPATH; each passes over every plugin bootstrap, so none runs the other (before: RecursionError, then
    KeyError: 'sitecustomize') and the user's sitecustomize runs exactly once."""
    import shutil

    import trl_vlm_fixes

    other = tmp_path / "other-install"
    shutil.copytree(Path(trl_vlm_fixes.__file__).parent, other / "trl_vlm_fixes")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('user sitecustomize')\n")
    # the script starts the other installation's launcher (its own file: this process imported ours already)
    final = 'import sys; print("ran", sys.modules["trl_vlm_fixes"].ACTIVATION)'
    inner = f"import runpy, sys; run = runpy.run_path({str(other / 'trl_vlm_fixes' / 'launcher.py')!r})['run']; "
    inner += f"run(['--', sys.executable, '-c', '{final}'])"
    started = run([*launcher(), "run", "--", sys.executable, "-c", inner], env={"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert started.returncode == 0, started.stderr[-3000:]
    assert "RecursionError" not in started.stderr and "KeyError" not in started.stderr
    # once in each of the three Python processes: the launcher's own, the script, the final command
    assert started.stdout.count("user sitecustomize") == 3
    assert started.stdout.splitlines()[-1] == "ran launcher"


@pytest.mark.stack_independent  # the bootstrap: Python's site machinery, no TRL/vLLM code
def test_run_without_a_command_or_with_an_unknown_one_says_so(tmp_path: Path) -> None:
    empty = run([*launcher(), "run"], cwd=tmp_path)
    assert empty.returncode == 2 and "no command given" in empty.stderr
    unknown = run([*launcher(), "run", "--", "no-such-program-here"], cwd=tmp_path)
    assert unknown.returncode == 127 and "command not found: 'no-such-program-here'" in unknown.stderr


# The activation field is set by the launcher's bootstrap (stack-independent, as its other tests): validated stack
# only. TRL's path through the launcher on the newest stack:
# test_trl_cli_trains_through_the_launcher_and_crashes_without and test_every_accelerate_rank_gets_the_fixes.
@pytest.mark.stack_independent
def test_cli_status_json_says_how_it_was_activated(tmp_path: Path) -> None:
    result = run([*launcher(), "status", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["activation"] == "import" and "gdn_prefill" in report["patches"]
    launched = run([*launcher(), "run", "--", *launcher(), "status", "--json"], cwd=tmp_path)
    assert json.loads(launched.stdout)["activation"] == "launcher"


@pytest.mark.slow
def test_every_accelerate_rank_gets_the_fixes(tmp_path: Path) -> None:
    from conftest import free_port

    script = tmp_path / "rank.py"
    # one file per rank: both ranks share one stdout pipe, where their lines can run into each other (seen in CI)
    script.write_text(
        "import json, os, sys\nimport trl.trainer.grpo_trainer\nplugin = sys.modules['trl_vlm_fixes']\n"
        "states = {k: v['state'] for k, v in plugin.status()['patches'].items()}\n"
        "report = {'rank': int(os.environ['RANK']), 'activation': plugin.ACTIVATION, 'states': states}\n"
        "open(f\"rank{os.environ['RANK']}.json\", 'w').write(json.dumps(report))\n"
    )
    accelerate = [*accelerate_two_cpu_ranks(free_port()), str(script)]
    launched = run([*launcher(), "run", "--", *accelerate], env={"ACCELERATE_USE_CPU": "1"}, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["activation"] == "launcher" and r["states"]["mm_realign"] == "applied" for r in ranks)


def write_cli_job(model_dir: Path, tmp_path: Path) -> Path:
    """A local dataset (parquet, the mixed image rows) and a `trl grpo` YAML config pointing at the tiny model."""
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, mixed_dataset

    data = tmp_path / "data"
    data.mkdir()
    mixed_dataset(MIXED_SAMPLES).to_parquet(str(data / "train.parquet"))
    # the reward lives beside the config, not in the plugin: importing it must not load the fixes
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nreward_funcs: [my_rewards.length_reward]\n"
        f"output_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 4\nnum_generations: 2\n"
        "max_completion_length: 8\nmax_steps: 2\nlogging_steps: 1\nreport_to: none\nuse_cpu: true\nbf16: false\n"
        "save_strategy: 'no'\nseed: 0\ndtype: float32\n"
    )
    return config


@pytest.mark.slow
def test_trl_cli_trains_through_the_launcher_and_crashes_without(loving_cli_model: Path, tmp_path: Path) -> None:
    """TRL's own CLI, a tiny VLM whose policy loves its placeholders, the mixed image batch: `trl grpo` crashes at the
    scoring pass on its own and trains both steps through the launcher."""
    from helpers import upstream_suppresses_image_token

    config = write_cli_job(loving_cli_model, tmp_path)
    trl = str(Path(sys.executable).parent / "trl")
    plain = run([trl, "grpo", "--config", str(config)], cwd=tmp_path, timeout=400)
    if not upstream_suppresses_image_token():  # TRL >= 1.16 suppresses the image pad on this path itself
        assert plain.returncode != 0
        assert "Image features and image tokens do not match" in plain.stderr or "not an iterator" in plain.stderr
    launched = run([*launcher(), "run", "--", trl, "grpo", "--config", str(config)], cwd=tmp_path, timeout=400)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "train_runtime" in launched.stdout + launched.stderr
    # the trainer-start line is INFO in a healthy run (not shown without logging set up); the fixes' metrics are logged
    assert "trl_vlm_fixes/vision_token_rows_masked" in launched.stdout + launched.stderr
    assert "trl_vlm_fixes" not in plain.stdout + plain.stderr  # the plain run never had the plugin


@pytest.fixture(scope="session")
def loving_cli_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForImageTextToText

    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    directory = build_tiny_qwen35_vlm(tmp_path_factory.mktemp("cli-loving"))
    model = AutoModelForImageTextToText.from_pretrained(directory)
    with torch.no_grad():
        model.lm_head.weight[[model.config.image_token_id, model.config.video_token_id]] *= 50.0
    model.save_pretrained(directory)
    return directory


SERVE_SITE = Path(__file__).parent / "programs" / "serve_site"
# the two ways users start TRL 1.9.1's server: the `trl` console script and the module
SERVER = {
    "trl vllm-serve": [str(Path(sys.executable).parent / "trl"), "vllm-serve"],
    "python -m": [sys.executable, "-m", "trl.scripts.vllm_serve"],
}


def serve(command: list[str], model: Path, tmp_path: Path, **env: str) -> tuple[Any, list[dict[str, Any]]]:
    """Start TRL's server with the engine stand-in (``programs/serve_site``): what reached each worker's engine."""
    from helpers import server_engine_build_problem_in_llm_worker

    pytest.importorskip("vllm")
    if not server_engine_build_problem_in_llm_worker():
        pytest.skip("this TRL's vllm-serve builds its engine elsewhere: server-mode engine fixes cover TRL 1.9.1")
    records = tmp_path / "engines"
    records.mkdir()
    environment = {"PYTHONPATH": str(SERVE_SITE), "SERVE_RECORD_DIR": str(records), **env}
    launched = run([*command, "--model", str(model)], env=environment, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr[-3000:]
    return launched, [json.loads(path.read_text()) for path in sorted(records.glob("engine-*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("started", "start_method", "workers"),
    [
        ("trl vllm-serve", "fork", 1),
        ("python -m", "fork", 2),
        ("python -m", "spawn", 2),
        ("trl vllm-serve", "spawn", 2),
    ],
)
def test_trl_vllm_serve_engine_gets_the_engine_arguments_however_it_is_started(
    tiny_model_dir: Path, tmp_path: Path, started: str, start_method: str, workers: int
) -> None:
    """Under `python -m` the server is `__main__` (`__mp_main__` in spawned workers), not `trl.scripts.vllm_serve`."""
    command = [*launcher(), "run", "--", *SERVER[started], "--data_parallel_size", str(workers)]
    launched, engines = serve(command, tiny_model_dir, tmp_path, SERVE_START_METHOD=start_method)
    assert len(engines) == workers
    for engine in engines:
        assert engine["kwargs"]["gdn_prefill_backend"] == "triton"
        assert "compilation_config" not in engine["kwargs"]  # vLLM's own mode: the server knows of no hang
        assert engine["kwargs"]["worker_extension_cls"] == "trl.scripts.vllm_serve.WeightSyncWorkerExtension"
        assert engine["states"] == {"cudagraph": "applied", "gdn_prefill": "applied"}
        assert engine["routed"] == "1"  # sampling_parity's engine wrapper routes this engine's steps (inherited)
    lines = [line for line in launched.stderr.splitlines() if line.startswith("trl_vlm_fixes: trl vllm-serve built")]
    assert len(lines) == workers and all(
        "built the vLLM engine with cudagraph_mode=vLLM's own (not protected: trl vllm-serve reads no trainer's "
        "output_dir" in line
        for line in lines
    )


@pytest.mark.slow
def test_trl_vllm_serve_without_the_plugin_builds_the_upstream_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    launched, engines = serve(SERVER["python -m"], tiny_model_dir, tmp_path)
    assert len(engines) == 1 and engines[0]["states"] == {} and engines[0]["routed"] is None
    assert "gdn_prefill_backend" not in engines[0]["kwargs"] and "compilation_config" not in engines[0]["kwargs"]
    assert "trl_vlm_fixes" not in launched.stderr


@pytest.mark.slow
def test_trl_vllm_serve_engine_the_fixes_miss_is_reported_skipped(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Another library's wrapper below the fixes' on vLLM's constructor: they cannot apply, and say so."""
    command = [*launcher(), "run", "--", *SERVER["python -m"]]
    launched, engines = serve(command, tiny_model_dir, tmp_path, SERVE_FOREIGN_WRAPPER="1")
    assert len(engines) == 1 and engines[0]["states"] == {"cudagraph": "skipped", "gdn_prefill": "skipped"}
    assert "compilation_config" not in engines[0]["kwargs"]
    warnings = [line for line in launched.stderr.splitlines() if "nothing was injected" in line]
    # the engine fixes that act on this model (Gated-DeltaNet, no routed experts: expert_layout would not have acted)
    assert sorted(line.split(": ")[1] for line in warnings) == ["cudagraph", "gdn_prefill"]


ADVICE = "trl_vlm_fixes: this is vLLM's own server, which `trl vllm-serve` (TRL >= 1.11) starts in its place"


@pytest.mark.slow
def test_trl_vllm_serve_that_execs_vllms_server_says_which_flags_to_pass(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL >= 1.11 replaces itself with `python -m vllm.entrypoints.cli.main serve` (os.execve): the engine fixes
    cannot reach that engine. Under the launcher the exec'd server (here it stops early: no uvicorn, no GPU) says
    once which of vLLM's flags give it their settings; with those flags given, nothing to say; without the
    launcher, silence (the engine runs without the settings)."""
    from helpers import flashinfer_gdn_prefill_kernel_replaced, server_engine_build_problem_in_llm_worker

    pytest.importorskip("vllm")
    if server_engine_build_problem_in_llm_worker():
        pytest.skip("this TRL's vllm-serve builds LLM(...) in llm_worker, where the engine fixes reach it")
    server = [*SERVER["trl vllm-serve"], "--model", str(tiny_model_dir)]

    def advice(command: list[str]) -> list[str]:
        launched = run(command, cwd=tmp_path, timeout=240)
        in_vllm_server = os.path.join("vllm", "entrypoints", "cli", "main.py")  # TRL exec'd it; it stopped there
        assert in_vllm_server in launched.stderr, launched.stderr[-3000:]
        return [line for line in launched.stderr.splitlines() if line.startswith(ADVICE)]

    [line] = advice([*launcher(), "run", "--", *server])
    assert f"The served model ({tiny_model_dir}) has Gated-DeltaNet layers" in line
    assert """--compilation-config '{"cudagraph_mode": "PIECEWISE"}'""" in line
    assert ("--gdn-prefill-backend triton" in line) != flashinfer_gdn_prefill_kernel_replaced()
    flags = ["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}', "--gdn-prefill-backend", "triton"]
    assert advice([*launcher(), "run", "--", *server, *flags]) == []
    assert advice(server) == []
    # README's YAML route: TRL writes unknown keys as `--compilation_config <value>`, which vLLM reads too
    config = tmp_path / "serve.yaml"
    config.write_text('compilation_config: \'{"cudagraph_mode": "PIECEWISE"}\'\ngdn_prefill_backend: triton\n')
    assert advice([*launcher(), "run", "--", *server, "--config", str(config)]) == []


@pytest.mark.parametrize(
    ("given", "still_advised"),
    [
        ([], True),
        (["--compilation-config", '{"cudagraph_mode": "PIECEWISE"}'], False),
        (["--compilation_config", '{"cudagraph_mode": "NONE"}'], False),
        (['--compilation-config={"cudagraph_mode": "FULL"}'], False),
        (["-cc.cudagraph_mode=PIECEWISE"], False),
        (["--compilation-config", '{"mode": 3}'], True),  # a compilation config without the mode
    ],
)
def test_server_advice_reads_the_compilation_config_as_vllm_does(given: list[str], still_advised: bool) -> None:
    from trl_vlm_fixes.server_flags import TRL_SERVER_COMMAND, TRL_SERVER_FLAG, flags_to_pass, protection_flag

    argv = ["python", *TRL_SERVER_COMMAND, "model", TRL_SERVER_FLAG, '{"backend": "nccl"}', *given]
    offered = [*flags_to_pass(argv), protection_flag(argv)]
    advised = [flag for flag in offered if flag and flag.startswith("--compilation-config")]
    assert bool(advised) == still_advised


def test_server_advice_is_as_wide_as_the_model(tiny_model_dir: Path, tiny_text_model_dir: Path, caplog: Any) -> None:
    """Flags that take CUDA graphs away are advised for a Gated-DeltaNet model only: a model without such layers gets
    one line saying none is needed; a model whose config is not on this machine (a hub id not downloaded yet: the
    advice never downloads) gets the advice stated as conditional."""
    from trl_vlm_fixes.server_flags import TRL_SERVER_COMMAND, TRL_SERVER_FLAG, advise_trl_server

    def advice(model: str) -> str:
        argv = ["python", *TRL_SERVER_COMMAND, model, TRL_SERVER_FLAG, '{"backend": "nccl"}']
        caplog.clear()
        with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
            advise_trl_server(argv, {"VLLM_SERVER_DEV_MODE": "1"})
        [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith(ADVICE)]
        return line

    gated = advice(str(tiny_model_dir))
    assert "has Gated-DeltaNet layers" in gated and "--compilation-config" in gated
    plain = advice(str(tiny_text_model_dir))
    assert f"none is needed: the served model ({tiny_text_model_dir}) has no Gated-DeltaNet layers" in plain
    assert "--compilation-config" not in plain and "--gdn-prefill-backend" not in plain
    unknown = advice("nobody/not-downloaded-model")
    assert "For a Qwen3.5 (Gated-DeltaNet) model (this one's config could not be read here)" in unknown
    assert "--compilation-config" in unknown


def test_server_advice_names_the_expert_backend_for_a_model_with_routed_experts(
    family_model_dir: Callable[[str], Path], tiny_model_dir: Path, caplog: Any
) -> None:
    """vLLM's own server (TRL >= 1.11) is out of expert_layout's reach: for a model with routed experts it says to
    pass ``--moe-backend triton`` (unless the command names a backend); for a dense model it says nothing of it."""
    from trl_vlm_fixes.server_flags import TRL_SERVER_COMMAND, TRL_SERVER_FLAG, advise_trl_server

    def expert_lines(model: Path, *given: str) -> list[str]:
        argv = ["python", *TRL_SERVER_COMMAND, str(model), TRL_SERVER_FLAG, "{}", *given]
        caplog.clear()
        with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
            advise_trl_server(argv, {"VLLM_SERVER_DEV_MODE": "1"})
        return [r.getMessage() for r in caplog.records if "has routed experts" in r.getMessage()]

    [line] = expert_lines(family_model_dir("qwen3_5_moe"))
    assert line.startswith(ADVICE) and "pass --moe-backend triton to `trl vllm-serve`" in line
    assert expert_lines(family_model_dir("qwen3_5_moe"), "--moe_backend", "triton") == []
    assert expert_lines(tiny_model_dir) == []


ADVICE_PROBE = """
import json, socket, sys
connections = []
socket.socket.connect = lambda self, address: connections.append(str(address))
from trl_vlm_fixes.server_flags import TRL_SERVER_COMMAND, TRL_SERVER_FLAG, advise_trl_server
import logging
lines = []
class Collect(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("trl_vlm_fixes").addHandler(Collect())
advise_trl_server(["python", *TRL_SERVER_COMMAND, *sys.argv[1:], TRL_SERVER_FLAG, "{}"], {"VLLM_SERVER_DEV_MODE": "1"})
print(json.dumps({"lines": lines, "torch": "torch" in sys.modules, "connections": connections}))
"""


def test_server_advice_reads_a_hub_model_from_the_cache_only(
    tiny_model_dir: Path, tiny_text_model_dir: Path, tmp_path: Path
) -> None:
    """A hub id is read from the Hugging Face cache at the revision the command names, as JSON: no connection, no
    torch imported before vLLM's own start-up (which must precede it), no remote code."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--model"
    for revision, sha, source in [("main", "a" * 40, tiny_model_dir), ("text-only", "b" * 40, tiny_text_model_dir)]:
        (repo / "snapshots" / sha).mkdir(parents=True)
        (repo / "snapshots" / sha / "config.json").write_text((source / "config.json").read_text())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(sha)

    def probe(*argv: str) -> dict[str, Any]:
        launched = run([sys.executable, "-c", ADVICE_PROBE, *argv], env={"HF_HUB_CACHE": str(cache)}, cwd=tmp_path)
        assert launched.returncode == 0, launched.stderr[-2000:]
        result = last_json_line(launched.stdout)
        assert not result["torch"] and result["connections"] == [], result
        [line] = [line for line in result["lines"] if line.startswith(ADVICE)]
        return {**result, "line": line}

    assert "The served model (org/model) has Gated-DeltaNet layers" in probe("org/model")["line"]
    assert "none is needed" in probe("org/model", "--revision", "text-only")["line"]
    assert "could not be read here" in probe("org/other")["line"]
    assert "has Gated-DeltaNet layers" in probe(str(tiny_model_dir))["line"]


def test_status_says_the_engine_fixes_do_not_reach_vllms_own_server() -> None:
    """TRL >= 1.11: the server target steps aside with the reason, instead of reading `LLM.__init__ wrapped`."""
    from helpers import server_engine_build_problem_in_llm_worker

    pytest.importorskip("vllm")
    code = "import json, trl_vlm_fixes, vllm.entrypoints.llm; print(json.dumps(trl_vlm_fixes.status()['patches']))"
    patches = last_json_line(run([sys.executable, "-c", code]).stdout)
    detail = patches["cudagraph"]["detail"]
    if server_engine_build_problem_in_llm_worker():
        assert "LLM.__init__ wrapped" in detail and "execs vLLM's own server" not in detail
    else:
        assert "LLM.__init__: not for `trl vllm-serve`: this TRL execs vLLM's own server" in detail, detail
        assert "LLM.__init__ wrapped" not in detail
