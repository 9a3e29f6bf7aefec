"""The same scheduler class under vLLM's own OpenAI server, with the engine core in a process
of its own and tensor parallelism 2 (two worker processes, one thread each on vLLM's CPU
build): the cap holds, and each step's timing reaches the policy from rank 0 through vLLM's
own output path, once per step and in order."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from tests.vllm_model import write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WORDS = "the house of the river by the garden in summer "
CAP = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(model, steps, port) -> subprocess.Popen:
    config = {"edgeprefill": {"policy": f"static:{CAP}", "steps": str(steps)}}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        "256",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        "--scheduling-policy",
        "priority",
        "--no-enable-prefix-caching",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
        "--scheduler-cls",
        "edgeprefill.backends.vllm.scheduler.EdgeprefillScheduler",
        "--worker-cls",
        "edgeprefill.backends.vllm.worker.TimedCPUWorker",
        "--additional-config",
        json.dumps(config),
    ]
    # One core for each rank's threads (vLLM cannot bind two ranks to one NUMA node itself).
    first, second = sorted(os.sched_getaffinity(0))[:2]  # whichever cores this process has
    bind = f"{first}|{second}"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_LOGGING_LEVEL": "WARNING"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def complete(base: str, prompt: str, max_tokens: int, priority: int) -> dict:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "priority": priority,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")
def test_under_vllm_serve_with_two_ranks_the_cap_holds_and_each_step_is_timed_once(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    steps, port = tmp_path / "steps.jsonl", free_port()
    base = f"http://127.0.0.1:{port}"
    server = start(model, steps, port)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not start within 300 s"
            time.sleep(1)
        # Two documents (priority 1) being read while three chats (priority 0) arrive.
        with ThreadPoolExecutor(5) as pool:
            docs = [pool.submit(complete, base, WORDS * 70, 4, 1) for _ in range(2)]
            time.sleep(0.3)
            chats = [pool.submit(complete, base, WORDS, 8, 0) for _ in range(3)]
            usage = [f.result() for f in docs + chats]
    finally:
        server.terminate()
        server.wait(60)
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    # One record per step, in step order, each with the time its workers measured.
    assert [s["step"] for s in lines] == list(range(len(lines)))
    assert all(s["duration_s"] > 0 for s in lines)
    # The cap held in every step, decodes untouched, and tokens reconcile with the usage.
    assert max(s["n_prefill"] for s in lines) <= CAP
    assert sum(s["n_prefill"] for s in lines) == sum(u["prompt_tokens"] for u in usage)
    assert sum(s["n_decode"] for s in lines) == sum(u["completion_tokens"] - 1 for u in usage)
    assert {s["decision"]["reason"] for s in lines} == {f"a fixed {CAP}-token chunk"}
