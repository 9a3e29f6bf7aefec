"""The vLLM backend: the runtime's budget policies inside vLLM's own V1 scheduler.

Unlike llama.cpp, vLLM schedules by itself, so here the runtime does not plan batches: a
scheduler mixin (`scheduler`) caps the step's prompt tokens with the policy's budget, a
worker subclass (`worker`) times each completed step, and `engine.VllmEngine` replays a
workload through vLLM's `LLMEngine` with the same interface as the runtime's `Engine`.
Importing this package loads nothing from vLLM; `check.require_vllm` says what is missing.

vLLM calls an iteration a step (`LLMEngine.step`, one `schedule()` and one model call); the
prose here keeps vLLM's word where it speaks of vLLM's code, and names are the runtime's.
"""
