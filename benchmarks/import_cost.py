"""The plugin's own import cost as a ratio of `import trl.trainer.grpo_trainer`, measured in one run.

Each figure is the median over fresh interpreters. Goal: at most 2%.
    python benchmarks/import_cost.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

TIMER = "import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"


def seconds(stmt: str, runs: int) -> float:
    samples = []
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", TIMER.format(stmt=stmt)], capture_output=True, text=True, check=True
        )
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    plugin = seconds("import trl_vlm_fixes", runs)
    trl = seconds("import trl.trainer.grpo_trainer", runs)
    both = seconds("import trl_vlm_fixes, trl.trainer.grpo_trainer", runs)
    print(f"import trl_vlm_fixes                       {plugin * 1000:9.1f} ms")
    print(f"import trl.trainer.grpo_trainer            {trl * 1000:9.1f} ms")
    print(f"both (plugin first, hooks fire on import)  {both * 1000:9.1f} ms")
    print(f"plugin import / grpo_trainer import        {plugin / trl:9.4%}   (goal <= 2%)")
    print(f"plugin + patching overhead / grpo import   {(both - trl) / trl:9.4%}   (noise: +-1-2%)")


if __name__ == "__main__":
    main()
