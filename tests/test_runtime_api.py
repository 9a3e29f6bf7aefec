"""The embedding API on the real model: streaming, cancellation, many threads at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from edgeprefill.backends.llamacpp.probe import plain_tokens
from edgeprefill.runtime import Runtime
from edgeprefill.runtime.core.request import DEFAULT_TTFT_SLOWDOWN, Status
from edgeprefill.runtime.policies import DEFAULT_POLICY, parse_policy
from edgeprefill.runtime.policies.static import StaticPolicy
from tests.terminal import python_from_a_terminal

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Write two sentences about the sea."}]


def test_streamed_pieces_concatenate_to_the_text_of_the_tokens(make_backend):
    be = make_backend()
    with Runtime(be) as rt:  # the default policy, its targets measured on this device now
        assert rt.policy.name == DEFAULT_POLICY and rt.policy.itl_ms > 0
        handle = rt.chat(QUESTION, max_tokens=32, ignore_eos=True)
        pieces = list(handle)
        req = handle.result(timeout=60)
    # its first-token target is relative to this device: a multiple of its prompt alone
    assert req.ttft_target_s is None and req.ttft_slowdown == DEFAULT_TTFT_SLOWDOWN["foreground"]
    assert 0 < req.ttft_alone_s < 5
    assert [p.token for p in pieces if p.token is not None] == req.output
    assert len(req.output) == 32 and req.status is Status.FINISHED
    assert "".join(p.text for p in pieces) == be.tokenizer.decode(req.output)
    assert [p.time_s for p in pieces if p.token is not None] == req.token_times_s


def test_the_async_iterator_streams_inside_asyncio_run(make_backend):
    be = make_backend()

    async def main() -> list:
        with Runtime(be, "static:64") as rt:
            handle = rt.chat(QUESTION, max_tokens=12, ignore_eos=True)
            return [piece async for piece in handle]

    pieces = asyncio.run(main())
    assert len([p for p in pieces if p.token is not None]) == 12


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_cancel_in_prefill_in_decode_twice_and_after_the_end(make_backend):
    be = make_backend(n_seq_max=4)
    toks = plain_tokens(be.model, 5000)

    def chats(rt: Runtime) -> list:
        return [
            rt.chat(toks[:90], max_tokens=20, ignore_eos=True, request_id="a"),
            rt.chat(toks[100:230], max_tokens=20, ignore_eos=True, request_id="b"),
        ]

    with Runtime(be, "static:32") as rt:
        reference = {h.id: h.result(timeout=120).output for h in chats(rt)}

    with Runtime(be, "static:32") as rt:
        doc = rt.index(toks[:1] + toks[1000:4000], max_tokens=8)
        wait_until(lambda: doc.request.num_computed > 0)  # in prefill: 3,000 tokens at 32
        doc.cancel()
        others = chats(rt)
        long = rt.chat(toks[300:400], max_tokens=500, ignore_eos=True)
        for n, _ in enumerate(long, 1):
            if n == 3:  # in decode
                long.cancel()
                long.cancel()  # twice: no effect
        done = rt.chat(toks[500:560], max_tokens=4, ignore_eos=True)
        finished = done.result(timeout=120)
        done.cancel()  # after the end: stays as it ended
        results = {h.id: h.result(timeout=120) for h in others}
        assert all(h.result(timeout=120).error == "cancelled" for h in (doc, long))
    assert 0 < doc.request.num_computed < 3001 and not doc.request.output
    assert 3 <= len(long.request.output) < 500
    assert finished.status is Status.FINISHED and finished.error is None
    assert {rid: r.output for rid, r in results.items()} == reference  # others unchanged
    sched = rt.engine.scheduler
    assert sched.kv_free == be.capacity.n_ctx and not sched.running  # cells returned
    # Each sequence empty, or parked with what it computed for a prompt that continues it.
    assert all(be.seq_pos_max(s) == -1 or s in sched.parked for s in range(4))
    assert be._samplers == {}


def test_eight_threads_submitting_at_once_lose_nothing(make_backend, tmp_path):
    be = make_backend(n_seq_max=8)
    toks = plain_tokens(be.model, 4000)
    handles, lock = [], threading.Lock()

    def user(i: int) -> None:
        for j in range(3):
            start = 300 * i + 50 * j
            if j == 1:
                h = rt.index(toks[:1] + toks[start : start + 200], max_tokens=4)
            else:
                h = rt.chat(toks[start : start + 60], max_tokens=6, ignore_eos=True)
            if i == 0 and j == 2:
                h.cancel()
            with lock:
                handles.append(h)

    with Runtime(be, "static:64", results=tmp_path / "run") as rt:
        threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ended = [h.result(timeout=300) for h in handles]
        # Idle now: every iteration that ran is on disk before any shutdown, as a served
        # runtime's results folder should be for whoever reads it.
        prefilled = sum(r.record()["prefilled_tokens"] for r in ended)
        deadline = time.monotonic() + 30
        while _prefill_written(tmp_path / "run" / "iterations.jsonl") < prefilled:
            assert time.monotonic() < deadline, "iterations not written while idle"
            time.sleep(0.05)
    assert len({h.id for h in handles}) == 24
    for req in ended:
        assert req.status is Status.FINISHED or req.error == "cancelled", req.error
    assert sum(r.status is Status.FINISHED for r in ended) >= 23
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["accounting"]["submitted"] == 24 and summary["accounting"]["reconciled"]
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(h.id for h in handles)


def test_asking_about_an_indexed_document_computes_only_the_question(make_backend, tmp_path):
    be = make_backend()
    document = " ".join(f"The lighthouse keeper logged ship number {i}." for i in range(60))
    with Runtime(be, "static:64") as rt:
        first = rt.index(document, max_tokens=4)
        early = rt.ask(first, "What did the keeper log?", max_tokens=8)
        doc = rt.index(document, max_tokens=4)
        doc.result(timeout=120)
        answer = rt.ask(doc, "What did the keeper log?", max_tokens=8, ignore_eos=True)
        req = answer.result(timeout=120)
    kept = doc.request.share_prefix
    # Asked before the document was read: it waited for the read rather than computing the
    # document a second time beside it, and its clock ran from when it was asked.
    asked = early.result(timeout=120)
    assert asked.status is Status.FINISHED
    assert asked.prefix_reused_tokens >= kept - be.capacity.chunk_quantum
    assert asked.arrival_s - first.request.arrival_s < 1.0
    assert kept and req.prefix_reused_tokens >= kept - be.capacity.chunk_quantum
    assert req.prompt[:kept] == doc.request.prompt[:kept]  # the document, token for token
    assert req.record()["prefilled_tokens"] == req.prompt_len - req.prefix_reused_tokens
    assert len(req.output) == 8


def _prefill_written(path) -> int:
    """Prompt tokens in the whole lines of iterations.jsonl so far."""
    text = path.read_text()
    lines = text.splitlines()[: text.count("\n")]  # not a line still being written
    return sum(r["n_prefill"] for r in map(json.loads, lines) if r["error"] is None)


ASSISTANT = """
import sys, time
from pathlib import Path
from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.probe import plain_tokens
from edgeprefill.runtime import Runtime

out = Path(sys.argv[1])
with LlamaCppBackend(LlamaCppConfig(model=default_model_path(), n_ctx=8192)) as be:
    rt = Runtime(be, "static:64", results=out)
    chat = rt.chat([{"role": "user", "content": "Hello."}], max_tokens=4, ignore_eos=True)
    chat.result(timeout=120)
    docs = [rt.index(plain_tokens(be.model, 6000)[k:], max_tokens=8) for k in (0, 7)]
    print("shutting down", flush=True)
    try:
        rt.shutdown()  # waits for both documents: minutes on a CPU
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("finished", flush=True)
"""


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_shutdown_keeps_finished_requests_and_marks_the_run(
    tmp_path, kv_cache_folder, signum
):
    """An assistant stopped (Ctrl-C, or the OS's SIGTERM) while its runtime waits for the
    indexer at shutdown: the finished chat is kept, the documents fail with "interrupted",
    the summary says interrupted, and no half-written file is left in the KV-state folder."""
    import signal
    import subprocess

    script = tmp_path / "assistant.py"
    script.write_text(ASSISTANT)
    out = tmp_path / "results"
    proc = subprocess.Popen(
        python_from_a_terminal(str(script), str(out)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "shutting down\n"
    time.sleep(2)  # into the documents' prompts
    sent = time.monotonic()
    proc.send_signal(getattr(signal, signum))
    stdout, stderr = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    expected = 130 if signum == "SIGINT" else -signal.SIGTERM
    assert proc.returncode == expected, stderr
    assert "Traceback" not in stderr and "finished" not in stdout
    assert took < 20  # the stop did not wait for the documents (minutes)
    summary = json.loads((out / "summary.json").read_text())
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert summary["interrupted"] and summary["accounting"]["reconciled"]
    assert [r["error"] for r in requests] == [None, "interrupted", "interrupted"]
    assert not list(kv_cache_folder.glob("*.tmp*"))


ONE_TEAM = """
import os, sys, threading
from pathlib import Path
from contextlib import closing
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.native import release_openmp_threads
from edgeprefill.runtime import Runtime
from edgeprefill.runtime.runner.calibration import probe_device

def native_threads():  # threads started since `before` that Python did not start
    now = {int(t) for t in os.listdir("/proc/self/task")}
    return len(now - before - {t.native_id for t in threading.enumerate()})

config = LlamaCppConfig(model=Path(sys.argv[1]), n_ctx=2048, n_threads=2, n_seq_max=2)
before = {int(t) for t in os.listdir("/proc/self/task")}
with closing(LlamaCppBackend(config)) as be:
    print(native_threads())  # after the batch-shape probe (measured or read)
    probe_device(be)  # graphs on this thread start its team
    print(native_threads())
    release_openmp_threads()
    print(native_threads())
    with Runtime(be, "cadence") as rt:  # probes the device again, on its engine thread
        rt.chat([{"role": "user", "content": "Hello"}], max_tokens=4).result(120)
        print(native_threads())
"""


def test_every_graph_of_a_runtime_runs_from_its_engine_thread(model_path):
    """llama.cpp built with OpenMP keeps a team of worker threads for each thread that ran a
    graph; a second team idle beside the engine's made libgomp's barriers sleep instead of
    spin, and under `serve` a one-row decode took 28-34 ms against 19 ms (history, section F).
    So a runtime probes the device on its engine thread, and a probe run on another thread
    releases its team: at 2 threads the process holds one llama.cpp worker thread, where
    OpenMP is used at all."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", ONE_TEAM, str(model_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.split()
    after_shapes, after_probe, released, serving = map(int, out)
    assert after_shapes == 0
    assert after_probe in (0, 1) and released == 0
    assert serving == after_probe  # the engine thread's team only


CTRL_C_WHILE_PROBING = """
import os, signal, sys, threading
from contextlib import closing
from pathlib import Path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.runtime import Runtime

# Ctrl-C as a terminal's user has it, whatever this process inherited: a shell's
# background job (`make test &`) starts with SIGINT ignored, and Python then keeps it so.
signal.signal(signal.SIGINT, signal.default_int_handler)
config = LlamaCppConfig(model=Path(sys.argv[1]), n_ctx=2048, n_threads=2, n_seq_max=2)
with closing(LlamaCppBackend(config)) as be:
    execute, calls = be.execute, []

    def execute_then_ctrl_c(work):
        calls.append(work)
        if len(calls) == 1:  # Ctrl-C lands while the probe computes, however fast it is
            os.kill(os.getpid(), signal.SIGINT)
        return execute(work)

    be.execute = execute_then_ctrl_c
    try:
        Runtime(be, "cadence")
    except KeyboardInterrupt:
        print("interrupted")
    print("after", len(calls) > 1)  # the probe went on to its end before the close
print("closed")
"""


def test_ctrl_c_while_a_runtime_probes_the_device_closes_the_backend_after_the_probe(
    model_path,
):
    """The probe runs on the engine thread: Ctrl-C on the caller's thread must not let it
    close the backend while the probe still computes on it (a crash, not an exit)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_PROBING, str(model_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["interrupted", "after", "True", "closed"]


def test_a_policy_built_in_code_is_named_in_the_summary_by_a_spec_that_reads_back(
    make_backend, tmp_path
):
    """summary.json says which policy ran, with its parameters, as `run` does: a policy
    object given to the API is written as the `--policy` spec that rebuilds it."""
    with Runtime(make_backend(), StaticPolicy(48), profile=None, results=tmp_path) as rt:
        assert rt.chat([2, 651, 3303], max_tokens=2).result(timeout=60).error is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["policy"]["spec"] == "static:tokens=48"
    assert parse_policy(summary["policy"]["spec"]) == StaticPolicy(48)
    assert summary["machine"]["logical_cores"] and summary["accounting"]["reconciled"]
