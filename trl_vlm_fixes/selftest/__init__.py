"""The self-test harness: never imported by ``import trl_vlm_fixes``, only by the CLI, the tests and the benchmarks.

``runner`` (``python -m trl_vlm_fixes selftest``) shows each bug with the fixes reverted and its absence with them
applied, running the check each fix names (``checks/<name>.py``; the fixes never import the harness, the checks
import what they need of their fix), on pieces built offline: ``tiny_model`` (tiny random Qwen checkpoints and
processors), ``engine_standin`` (a behavioural stand-in for the colocated vLLM engine, whose signatures follow the
real ``vllm`` classes), ``rollout_schedule`` (TRL's rollout/train order driven by hand), ``batch_scoring`` (batched
vs per-row log-probs) and ``fixtures`` (the mixed image batch and the tiny trainers shared with the tests and the
example).
"""
