"""A conversation resent whole at every turn, as every OpenAI client sends it, against
`edgeprefill serve` and llama-server's defaults through one client: first-token time by
turn, alone and beside three documents read in the background.

    benchmarks/build_llamacpp_tools.sh .venv/bin/python       # once: llama-server
    .venv/bin/python benchmarks/conversation.py --tools build/llamacpp-tools/build/bin \
        --out results/conversation [--rounds 3] [--threads 2]

Each turn is a 120-word question after the whole conversation so far (as text), sent as a
streamed `/v1/completions` at temperature 0 for a 48-token answer, one second after the
previous answer ended. Documents (~2,850 tokens each) go to `/v1/documents` on edgeprefill
and as long completions on llama-server (which has no background class), at the start.
The servers run one after the other, round by round (A B A B: the machine's speed drifts),
each started fresh: llama-server with its defaults for a conversation server (`-np 4 -c
32768`, its prompt cache in RAM on), edgeprefill with its own defaults. Writes one JSON
file per run and prints, per scenario, each server's mean first-token time over turns
2-10, turn 10 against turn 2, and when the documents were done.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from http_replay import ServeProcess, wait_healthy
from llama_server import HOST, stop, weights_layout

from edgeprefill.backends.bundled_model import default_model_path

TURNS, ANSWER_TOKENS, THINK_S, QUESTION_WORDS = 10, 48, 1.0, 120
DOCUMENTS, DOCUMENT_WORDS = 3, 2100  # ~2,850 tokens each
LLAMA_SERVER_ARGS = ["-np", "4", "-c", "32768"]
WORDS = (
    "river valley stone harbour winter market lantern orchard meadow bridge signal garden "
    "copper window station forest letter island thunder candle mirror pocket ladder engine "
    "shadow feather basket needle silver planet ribbon castle whistle marble compass anchor"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Client:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=600)

    def turn(self, prompt: str) -> tuple[float, str]:
        """Stream one answer; (seconds to its first text, the text)."""
        body = {
            "prompt": prompt,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        sent, first, text = time.monotonic(), None, []
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0].get("text") or ""
                if piece and first is None:
                    first = time.monotonic() - sent
                text.append(piece)
        assert first is not None, "no text came back"
        return first, "".join(text)

    def conversation(self, seed: int) -> list[float]:
        rng, history, ttfts = random.Random(seed), "A conversation with an assistant.\n", []
        for _ in range(TURNS):
            prompt = f"{history}User: {words(rng, QUESTION_WORDS)}\nAssistant:"
            ttft, answer = self.turn(prompt)
            ttfts.append(ttft)
            history = f"{prompt}{answer}\n"
            time.sleep(THINK_S)
        return ttfts


def read_documents(url: str, server: str, seed: int) -> tuple[threading.Thread, list[float]]:
    """The documents, given at once in the background; `done` gets when the last ended."""
    rng, started, done = random.Random(seed + 1000), time.monotonic(), []
    texts = [words(rng, DOCUMENT_WORDS) for _ in range(DOCUMENTS)]

    def edgeprefill() -> None:
        http = httpx.Client(base_url=url, timeout=600)
        ids = [
            http.post("/v1/documents", json={"text": t, "max_tokens": ANSWER_TOKENS}).json()["id"]
            for t in texts
        ]
        while any(http.get(f"/v1/documents/{i}").json()["status"] != "finished" for i in ids):
            time.sleep(0.1)

    def llama_server() -> None:
        body = {"max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(f"{url}/v1/completions",),
                kwargs={
                    "json": {**body, "prompt": t + "\n\nSummarize the text above."},
                    "timeout": 600,
                },
            )
            for t in texts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def run() -> None:
        (edgeprefill if server == "edgeprefill" else llama_server)()
        done.append(time.monotonic() - started)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done


class LlamaServer:
    def __init__(self, tools: Path, threads: int, log: Path) -> None:
        self.url, port = f"http://{HOST}:18091", "18091"
        args = [*LLAMA_SERVER_ARGS, "-t", str(threads)]
        cmd = [str(tools / "llama-server"), "-m", str(default_model_path()), "--host", HOST]
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [*cmd, "--port", port, *args, *weights_layout(args)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        if not wait_healthy(self.url, self.proc, 120):
            self.close()
            raise RuntimeError(f"llama-server did not come up; see {log}")

    def close(self) -> None:
        stop(self.proc, timeout_s=30)
        self._log.close()


def run_one(server: str, documents: bool, seed: int, args: argparse.Namespace, out: Path) -> Any:
    log = out.with_suffix(".log")
    if server == "edgeprefill":
        options = f"--no-progress --threads {args.threads} {args.serve_args}"
        proc: Any = ServeProcess(options, log)
    else:
        proc = LlamaServer(args.tools, args.threads, log)
    try:
        if documents:
            reader, done = read_documents(proc.url, server, seed)
        ttfts = Client(proc.url).conversation(seed)
        if documents:
            reader.join()
    finally:
        proc.close()
    result = {"server": server, "documents": documents, "seed": seed, "ttft_s": ttfts}
    result["documents_done_s"] = done[0] if documents else None
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(results: list[dict[str, Any]]) -> None:
    for documents in (False, True):
        print(f"\n{'with three documents' if documents else 'conversation alone'}")
        for server in ("edgeprefill", "llama-server"):
            runs = [r for r in results if r["server"] == server and r["documents"] == documents]
            if not runs:
                continue
            later = [statistics.mean(r["ttft_s"][1:]) for r in runs]
            every = [statistics.mean(r["ttft_s"]) for r in runs]
            growth = [r["ttft_s"][-1] / r["ttft_s"][1] for r in runs]
            line = f"  {server:<13} turns 2-10 {_span(later)} s, all turns {_span(every)} s, "
            line += f"turn 10 / turn 2 {_span(growth)}"
            if documents:
                line += f", documents done {_span([r['documents_done_s'] for r in runs])} s"
            print(line)


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tools", type=Path, help="folder holding llama-server")
    p.add_argument(
        "--servers", default="edgeprefill,llama-server", help="which, comma-separated, in order"
    )
    p.add_argument("--out", type=Path, default=Path("results/conversation"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", choices=["alone", "documents"], help="one scenario")
    p.add_argument("--serve-args", default="", help="more `edgeprefill serve` options")
    args = p.parse_args()
    servers = args.servers.split(",")
    if "llama-server" in servers and args.tools is None:
        p.error("--tools FOLDER is needed for llama-server (benchmarks/build_llamacpp_tools.sh)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    scenarios = [s == "documents" for s in ("alone", "documents") if args.only in (None, s)]
    for r in range(args.rounds):
        for documents in scenarios:
            for server in servers:
                name = f"{server}-{'docs' if documents else 'alone'}-{r}.json"
                path = args.out / name
                if path.exists():
                    results.append(json.loads(path.read_text()))
                    continue
                print(f"round {r}: {name}", flush=True)
                results.append(run_one(server, documents, r, args, path))
    report(results)


if __name__ == "__main__":
    main()
