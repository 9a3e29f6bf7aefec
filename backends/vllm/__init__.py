"""The vLLM backend: the runtime's budget policies inside vLLM's own V1 scheduler.

Unlike llama.cpp, vLLM schedules by itself, so here the runtime does not plan batches: a
scheduler mixin (`scheduler`) caps the step's prompt tokens with the policy's budget, a
worker subclass (`worker`) times each completed step, and `engine.VllmEngine` replays a
workload through vLLM's `LLMEngine` with the same interface as the runtime's `Engine`.
Importing this package loads nothing from vLLM; `check.require_vllm` says what is missing.
"""
