"""Replay a workload's trace through llama.cpp's own llama-server, the way users run an
assistant plus an indexer today, and write the same result files as `edgeprefill run`.

    benchmarks/build_llamacpp_tools.sh            # once: prints the tools' folder
    .venv/bin/python benchmarks/llama_server.py workloads/assistant_plus_indexer.yaml \
        --tools build/llamacpp-tools/build/bin --out results/server-default \
        [--server-args "-np 8 -b 256 -ub 256"]

The requests are exactly those `edgeprefill run` builds for the workload and seed (same
arrivals, prompt token ids, output lengths; `arrivals.jsonl` is byte-identical), sent as
token ids to `/completion` at their arrival times with streaming, greedy sampling,
`ignore_eos` as the workload says, and no prompt cache (`--prompt-cache`: llama-server's
default cache, for conversations; a turn resends the previous prompt and the answer's
token ids). Each streamed chunk's arrival is
its tokens' timestamp on the replay's clock. `requests.jsonl` and `summary.json` have
`edgeprefill run`'s fields, so `edgeprefill report` reads them and ratios compare.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp.native import LlamaModel, cpu_has_amx
from edgeprefill.backends.llamacpp.tokenizer import LlamaTokenizer
from edgeprefill.runtime.analysis.metrics import class_summary, completed
from edgeprefill.runtime.core.request import CLASSES, Request
from edgeprefill.runtime.traffic.build import build_requests, format_trace
from edgeprefill.runtime.traffic.workload import load_workload
from edgeprefill.thermal.machine import describe_machine

HOST = "127.0.0.1"


def weights_layout(args: list[str]) -> list[str]:
    """Options that make llama.cpp's tools load the weights as edgeprefill does: no AMX
    repacking, whose matmul faults (a segfault, or SIGILL at the first graph in a VM that
    lists AMX; see LlamaModel), unless `args` asks for it."""
    return ["--no-repack"] if cpu_has_amx() and "--repack" not in args else []


class Server:
    """llama-server on loopback, started and stopped with the replay."""

    def __init__(
        self, tools: Path, model: Path, port: int, args: list[str], log: Path, cache: bool = False
    ) -> None:
        """`cache`: llama-server's own defaults, its prompt cache on (`cache_prompt`,
        `--cache-ram`), where conversations resend what it has computed."""
        self.port, self.cache = port, cache
        self.cmd = [str(tools / "llama-server"), "-m", str(model), "--host", HOST]
        self.args = [*args, *weights_layout(args)]
        self.cmd += ["--port", str(port), *([] if cache else ["--cache-ram", "0"]), *self.args]
        self._log = log.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}); see {log}")
            try:
                conn = http.client.HTTPConnection(HOST, port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server did not become ready; see {log}")

    def complete(self, req: Request, clock: Any) -> None:
        """Stream one completion, stamping every token as its chunk arrives."""
        body = {
            "prompt": req.prompt,
            "n_predict": req.max_tokens,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": self.cache,
            "ignore_eos": req.ignore_eos,
            "temperature": 0.0,
        }
        conn = http.client.HTTPConnection(HOST, self.port, timeout=3600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            req.fail(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            now = clock()
            for token in chunk.get("tokens", []):
                req.output.append(token)
                req.token_times_s.append(now)
            if chunk.get("stop"):
                req.num_computed = int(chunk.get("tokens_evaluated", req.prompt_len))
                req.prefix_reused_tokens = int(chunk.get("timings", {}).get("cache_n", 0))
                stop = chunk.get("stop_type")
                req.finish_reason = "length" if stop == "limit" else "stop"
                break
        if req.finish_reason is None:
            req.fail("the stream ended without a final chunk")

    def answer(self, req: Request) -> list[int]:
        """The answer's tokens as the stream gave them."""
        return req.output

    def close(self) -> None:
        stop(self.proc, timeout_s=30)
        self._log.close()


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited after `timeout_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def replay(server: Server, requests: list[Request]) -> float:
    """Send every request at its arrival time (a closed-loop turn `think_s` after its
    predecessor ended); returns the replay's duration."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    done = {r.id: threading.Event() for r in requests}
    by_id = {r.id: r for r in requests}

    def one(req: Request) -> None:
        if req.after is not None:
            done[req.after].wait()
            release(server, req, by_id[req.after])
        time.sleep(max(0.0, req.arrival_s - clock()))
        try:
            server.complete(req, clock)
        except (OSError, ValueError) as e:
            req.fail(f"{type(e).__name__}: {e}")
        finally:
            done[req.id].set()

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return clock()


def release(server: Any, req: Request, before: Request) -> None:
    """A closed-loop turn, once `before` has answered: it arrives a think time later,
    and a conversation's resends `before`'s prompt and answer (`server.answer`)."""
    req.arrival_s = before.token_times_s[-1] + req.think_s
    req.follow(before, server.answer(before))


def summary(requests: list[Request], duration: float, meta: dict[str, Any]) -> dict[str, Any]:
    recs = [r.record() for r in requests]
    n_done = sum(completed(r) for r in recs)
    last = [r["token_times_s"][-1] for r in recs if r["token_times_s"]]
    return {
        **meta,
        "completed": n_done,
        "failed": len(recs) - n_done,
        "interrupted": False,
        "duration_s": duration,
        "makespan_s": max(last) - min(r["arrival_s"] for r in recs) if last else 0.0,
        "accounting": {
            "submitted": len(recs),
            "completed": n_done,
            "failed": len(recs) - n_done,
            "reconciled": all(completed(r) or r["error"] for r in recs),
        },
        **{c: class_summary([r for r in recs if r["class"] == c], duration) for c in CLASSES},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path)
    ap.add_argument("--tools", type=Path, required=True, help="folder with llama-server")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=16384, help="KV cells per slot")
    ap.add_argument(
        "--slots",
        type=int,
        default=0,
        help="llama-server's --parallel [default: not passed: its own default, 4 slots "
        "sharing one KV pool]",
    )
    ap.add_argument("--server-args", default="", help="more llama-server options, e.g. '-b 256'")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument(
        "--prompt-cache",
        action="store_true",
        help="llama-server's prompt cache on, as its defaults have it (for conversations) "
        "[default: off, every prompt computed]",
    )
    args = ap.parse_args()
    spec = load_workload(args.workload)
    model_path = default_model_path()
    requests = trace(spec, args.seed, args.out)
    server_args = ["-t", str(args.threads), "-c", str(args.n_ctx * (args.slots or 4))]
    server_args += (["-np", str(args.slots)] if args.slots else []) + shlex.split(args.server_args)
    started = datetime.now(UTC)
    log = args.out / "server.log"
    server = Server(args.tools, model_path, args.port, server_args, log, args.prompt_cache)
    server_args = server.args
    try:
        duration = replay(server, requests)
    finally:
        server.close()
    spec_text = "llama-server " + " ".join(server_args)
    backend = {"name": "llama-server", "args": server_args, "model": str(model_path)}
    meta = run_meta(
        backend, spec_text, args.workload, spec.seed if args.seed is None else args.seed, started
    )
    write_results(args.out, requests, duration, meta, spec_text)


def trace(spec: Any, seed: int | None, out: Path) -> list[Request]:
    """The requests `edgeprefill run` builds for the workload and seed, and their
    arrivals.jsonl in `out` (byte-identical to run's)."""
    model = LlamaModel(default_model_path())
    try:
        requests = build_requests(spec, LlamaTokenizer(model), seed)
    finally:
        model.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / "arrivals.jsonl").write_text(format_trace(requests))
    return requests


@contextmanager
def answers_tokenizer(requests: list[Request]) -> Iterator[LlamaTokenizer | None]:
    """The model's tokenizer where a conversation's turns resend answers the client read as
    text (see `http_replay.Endpoint.answer`); None where no turn does."""
    if not any(r.continues for r in requests):
        yield None
        return
    model = LlamaModel(default_model_path())
    try:
        yield LlamaTokenizer(model)
    finally:
        model.close()


def run_meta(
    backend: dict[str, Any], label: str, workload: Path, seed: int, started: datetime
) -> dict[str, Any]:
    """summary.json's description of a replay, in `edgeprefill run`'s fields."""
    return {
        "backend": backend,
        "simulated": False,
        "policy": {"name": backend["name"], "spec": label},
        "workload": {"name": load_workload(workload).name, "path": str(workload)},
        "seed": seed,
        "start_time": started.isoformat(),
        "machine": describe_machine(),
    }


def write_results(
    out: Path, requests: list[Request], duration: float, meta: dict[str, Any], label: str
) -> None:
    """requests.jsonl and summary.json as `edgeprefill run` writes them, and one line."""
    with (out / "requests.jsonl").open("w") as f:
        for r in requests:
            f.write(json.dumps(r.record()) + "\n")
    s = summary(requests, duration, meta)
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    fg, bg = s["foreground"], s["background"]
    print(
        f"{label}: {s['completed']}/{len(requests)} completed, makespan "
        f"{s['makespan_s']:.1f} s, fg mean TTFT {fg['mean_ttft_ms']:.0f} ms, fg P99 ITL "
        f"{fg['p99_itl_ms']:.0f} ms, bg makespan {bg['makespan_s']:.1f} s"
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
