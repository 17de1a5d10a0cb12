"""``cudagraph``'s self-test check: the CUDA-graph mode the engine TRL builds gets at each protection level."""

from __future__ import annotations

from pathlib import Path

from ... import protection
from ...patches.cudagraph import engine_cudagraph_mode, expected_mode
from ...protection import Level
from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """The CUDA-graph mode the engine TRL builds for a Gated-DeltaNet model gets, as vLLM's CompilationConfig reads
    it, in a fresh ``output_dir``, where the protection state records one engine hang, and where it records two:
    upstream, vLLM's default graphs (GDN decode captured) every time; with the fix, vLLM's mode (or the pinned one)
    first, then ``PIECEWISE``, then ``NONE``."""
    from ..rollout_schedule import build_generation

    def measure() -> dict[str, str]:
        modes = {}
        for level, output_dir in _protection_states(context, family).items():
            with protection.building_in(output_dir):
                generation = build_generation(context.model_dir(family), context.processor(family))
            modes[level.name] = engine_cudagraph_mode(generation.llm.init_kwargs.get("compilation_config"))
        return modes

    def bug(modes: dict[str, str]) -> tuple[bool | None, str]:
        captured = modes[Level.ENGINE_HANG.name] not in ("NONE", "PIECEWISE")
        return captured, f"fix off: the engine TRL builds for a Gated-DeltaNet model gets {_modes_text(modes)}"

    def fix(modes: dict[str, str]) -> tuple[bool | None, str]:
        expected = {level.name: expected_mode(level) for level in Level}
        return modes == expected, f"fix on: vLLM's CompilationConfig gets {_modes_text(modes)}"

    return off_then_on("cudagraph", measure, bug, fix)


def _modes_text(modes: dict[str, str]) -> str:
    return ", ".join(f"{name}: cudagraph_mode={mode}" for name, mode in modes.items())


def _protection_states(context: SelftestContext, family: str) -> dict[Level, Path]:
    """An ``output_dir`` per level, holding the protection state the watchdog leaves there: none, one engine hang at
    step 3, two (steps 3 and 5)."""
    folders = {}
    for level in Level:
        folder = Path(context.workdir) / f"cudagraph_{family}_{level.name.lower()}"
        hangs = [{"step": step, "kind": "engine-step", "rank": 0, "engine": True} for step in (3, 5)[:level]]
        if level:
            protection.write_state(folder, level, hangs)
        folder.mkdir(parents=True, exist_ok=True)
        folders[level] = folder
    return folders
