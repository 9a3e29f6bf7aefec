"""The embedding API: one engine thread over a backend and a budget policy, fed from any
thread, on either engine (the runtime's own over llama.cpp, or vLLM's).

A desktop assistant holds one `Runtime`, sends the person's conversation with `chat()`,
hands documents to the indexer with `index()`, and streams each answer from the handle it
gets back. Every request goes through the same scheduler and policy as `edgeprefill run`:
chats are foreground, documents background, and the policy decides each iteration how
many prompt tokens ride along with the decodes.

Only the engine thread touches the engine: `submit`, `cancel` and `shutdown` put commands
on a queue that it drains between iterations (`api.commands`: the driver loop of `run`,
fed by commands instead of a workload's arrival times).

The engine thread cannot end quietly: an exception in it (a backend, a policy, the results
writer) marks the runtime failed with the reason (`failure`), ends every request in flight
and queued with that reason, refuses new ones at once, and writes the results.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

from edgeprefill.runtime.api.chat_prompt import encode_chat
from edgeprefill.runtime.api.commands import Command, CommandLoop
from edgeprefill.runtime.api.handle import RequestHandle
from edgeprefill.runtime.api.handover import Handover
from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.contract import Backend
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.driver import SchedulingBackend
from edgeprefill.runtime.core.iteration import Iteration
from edgeprefill.runtime.core.request import (
    DEFAULT_TTFT_SLOWDOWN,
    Request,
    RequestClass,
    SamplingParams,
)
from edgeprefill.runtime.core.scheduler import BackgroundLimits
from edgeprefill.runtime.policies import DEFAULT_POLICY, parse_policy
from edgeprefill.runtime.replay.signals import on_stop_signals
from edgeprefill.runtime.results.writer import RunWriter, run_meta
from edgeprefill.runtime.runner.calibration import probe_device
from edgeprefill.runtime.runner.drivers import open_driver

log = logging.getLogger(__name__)

INDEX_INSTRUCTION = "Summarize the text above."


class Runtime:
    """Owns the engine thread; the caller owns the backend (close it after the runtime)."""

    def __init__(
        self,
        backend: Backend | SchedulingBackend,
        policy: BudgetPolicy | str = DEFAULT_POLICY,
        *,
        profile: DeviceProfile | Literal["probe"] | None = "probe",
        limits: BackgroundLimits | None = None,
        results: Path | None = None,
        on_iteration: Callable[[Iteration], None] | None = None,
        on_end: Callable[[Request], None] | None = None,
    ) -> None:
        """`profile`: the device profile a policy takes its defaults from ("probe": measured
        now, a few seconds, where the policy needs one). `results`: a folder that gets
        `requests.jsonl` and `iterations.jsonl` as the run goes and `summary.json` at
        shutdown, as `edgeprefill run` writes them. `on_iteration` and `on_end` are called
        on the engine thread with each iteration and each request that ended (a server's
        metrics); they must be quick."""
        self.backend = backend
        self.policy = parse_policy(policy) if isinstance(policy, str) else policy
        self._spec = policy if isinstance(policy, str) else self.policy.spec
        # A runtime restarted with the same folder keeps the earlier run's files.
        self._writer = RunWriter(results, keep_earlier=True) if results is not None else None
        self._on_iteration, self._on_end = on_iteration, on_end
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Streamed tokens reach event loops once an iteration, between device calls.
        self.handover = Handover()
        self._ids = itertools.count()
        # Held while checking `_closed` and queueing: no request can be queued after the
        # engine thread's last look at the queue.
        self._lock = threading.Lock()
        self._closed = False
        self.failure: str | None = None  # why the engine thread failed, once it has
        self._interrupted = False  # a signal stopped the shutdown's wait
        self._stopped = threading.Event()  # the engine thread's last act
        self._thread = self._start(profile, limits)

    def _start(
        self, profile: DeviceProfile | Literal["probe"] | None, limits: BackgroundLimits | None
    ) -> threading.Thread:
        """Start the engine thread and wait until it has probed the device and opened the
        driver; raise what failed there. Ctrl-C meanwhile waits for the probe to end and the
        thread to stop before it goes on: the caller then closes the backend, which the
        probe must not be using."""
        ready = threading.Event()
        failed: list[BaseException] = []
        thread = threading.Thread(
            target=self._run,
            args=(profile, limits, ready, failed),
            name="edgeprefill-engine",
            daemon=True,
        )
        thread.start()
        try:
            ready.wait()
        except BaseException:
            ready.wait()
            self.stop()
            self._stopped.wait()
            raise
        if failed:
            raise failed[0]
        return thread

    # --- requests in, from any thread ------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        cls: RequestClass = "foreground",
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        ttft_target_s: float | None = None,
        ttft_slowdown: float | Literal["class"] | None = "class",
        share_prefix: int | None = None,
        after_prefix_of: RequestHandle | None = None,
    ) -> RequestHandle:
        """Queue prompt token ids; the returned handle streams the answer. The first token
        is wanted within `ttft_slowdown` times what the prompt takes alone on this device
        ("class": the class's default, 3 for foreground, none for background; None: no
        relative target), or within `ttft_target_s` seconds where given (absolute).
        `share_prefix`: how many of the prompt's first tokens to keep for later prompts
        that start with them. `after_prefix_of`: a request whose kept prefix this prompt
        starts with; while it is still reading that prefix this one waits (its clock
        running), so the prefix is restored rather than computed twice side by side."""
        self._check(prompt, sampling, ttft_target_s=ttft_target_s, ttft_slowdown=ttft_slowdown)
        with self._lock:
            rid = request_id or f"{'chat' if cls == 'foreground' else 'doc'}-{next(self._ids)}"
        req = Request(
            rid,
            cls,
            self.engine.clock.now(),
            list(prompt),
            max_tokens,
            sampling=sampling or SamplingParams(),
            ignore_eos=ignore_eos,
            ttft_target_s=ttft_target_s,
            ttft_slowdown=DEFAULT_TTFT_SLOWDOWN[cls] if ttft_slowdown == "class" else ttft_slowdown,
            share_prefix=share_prefix,
        )
        handle = RequestHandle(
            req,
            self.backend.tokenizer.piece,
            lambda: self._commands.put(("cancel", req)),
            lambda kept: self._commands.put(("finish", (req, kept))),
            self.handover,
        )
        after = None if after_prefix_of is None else after_prefix_of.request
        with self._lock:
            if self._closed:
                raise RuntimeError(self.refusal)
            # A document being read must not delay a chat's first token. Before the add,
            # as `Engine.preempt` asks: the add clears the flag, and a flag set after it
            # stopped a later document-only iteration with no chat arriving.
            if cls == "foreground":
                self.engine.preempt()
            self._commands.put(("add", (handle, after)))
        return handle

    def chat(
        self, messages: list[dict[str, str]] | list[int], *, max_tokens: int = 256, **kw: Any
    ) -> RequestHandle:
        """A foreground answer to a conversation: {role, content} messages rendered with
        the model's own chat template, or token ids as they are."""
        return self.submit(self._prompt(messages), max_tokens=max_tokens, **kw)

    def index(
        self,
        document: str | list[int],
        *,
        instruction: str = INDEX_INSTRUCTION,
        max_tokens: int = 64,
        **kw: Any,
    ) -> RequestHandle:
        """A background request that reads a document (text or token ids) and answers
        `instruction` about it, for an indexer's summaries or tags. The document's KV state
        is kept where the backend keeps prefixes: `ask(handle, question)` then computes only
        the question."""
        prompt, kept = self.index_prompt(document, instruction)
        return self.submit(prompt, max_tokens=max_tokens, cls="background", share_prefix=kept, **kw)

    def index_prompt(
        self, document: str | list[int], instruction: str = INDEX_INSTRUCTION
    ) -> tuple[list[int], int]:
        """The prompt `index` submits, and how many of its first tokens are kept."""
        doc, instr, tail = self._user_turn(document, instruction)
        return doc + instr + tail, len(doc)

    def ask(
        self, document: RequestHandle, question: str, *, max_tokens: int = 256, **kw: Any
    ) -> RequestHandle:
        """A foreground answer to `question` about a document given to `index` earlier: the
        prompt is that document in the same template, then the question, so it starts with
        the tokens the indexer kept, whose state is restored, not computed again. Asked while
        the indexer still reads them, it waits until they are read (or the document ends)."""
        prompt = self.question_prompt(document, question)
        return self.submit(prompt, max_tokens=max_tokens, after_prefix_of=document, **kw)

    def question_prompt(self, document: RequestHandle, question: str) -> list[int]:
        """The prompt `ask` submits: the document's kept tokens, then the question."""
        kept = document.request.share_prefix
        if kept is None:
            raise ValueError("ask() takes a handle returned by index()")
        _, question_ids, tail = self._user_turn("", question)
        return document.request.prompt[:kept] + question_ids + tail

    def _user_turn(
        self, document: str | list[int], instruction: str
    ) -> tuple[list[int], list[int], list[int]]:
        """(chat prefix + document, "\n\n" + instruction, chat suffix) as token ids, built
        piece by piece so that every prompt about one document starts with the same ids."""
        tok = self.backend.tokenizer
        before, after = tok.chat_parts(None)
        head = tok.encode(before, add_bos=True, special=True)
        body = (
            tok.encode(document, add_bos=False, special=False)
            if isinstance(document, str)
            else list(document)
        )
        extra = (
            tok.encode("\n\n" + instruction, add_bos=False, special=False) if instruction else []
        )
        tail = tok.encode(after, add_bos=False, special=True)
        return head + body, extra, tail

    def _check(self, prompt: list[int], sampling: SamplingParams | None, **targets: Any) -> None:
        """ValueError for what `submit` cannot queue: llama.cpp aborts the whole process on
        an empty prompt or a token id outside the vocabulary."""
        n_vocab = self.backend.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if not prompt or bad is not None:
            what = "an empty prompt" if not prompt else f"token id {bad}"
            raise ValueError(f"{what}: prompts are token ids from 0 to {n_vocab - 1}")
        for name, value in targets.items():
            if isinstance(value, float | int) and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number above 0, got {value}")
        self.backend.check_sampling(sampling or SamplingParams())

    def _prompt(self, messages: list[dict[str, str]] | list[int]) -> list[int]:
        if all(isinstance(m, int) for m in messages):
            return cast(list[int], list(messages))
        return encode_chat(self.backend.tokenizer, cast(list[dict[str, str]], messages))

    # --- shutting down ------------------------------------------------------------------
    def stop(self, *, cancel: bool = False, cancel_background: bool = False) -> None:
        """Stop accepting requests and, with `cancel`, end those in flight (with
        `cancel_background`, the background ones), without waiting (a server's signal
        handler, which must not block its event loop); `shutdown` waits. Called again, it
        can still cancel what the first call let finish."""
        with self._lock:
            first, self._closed = not self._closed, True
            if first or cancel or cancel_background:
                reason = "cancelled at shutdown" if cancel else None
                self._commands.put(("stop", (reason, cancel_background)))

    @property
    def accepting(self) -> bool:
        return not self._closed

    @property
    def refusal(self) -> str:
        """Why a request is refused now: the engine failed, or the runtime is stopping."""
        if self.failure is not None:
            return f"{self.failure} (the results are written; restart to serve again)"
        return "the runtime was shut down: create a new one to submit"

    def shutdown(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting requests; finish what is in flight (or cancel it), then stop the
        engine thread and write the summary when results are kept.

        Ctrl-C or SIGTERM while it waits (on the main thread) stops the work in flight at
        once instead: those requests fail with reason "interrupted", the summary is
        written marked interrupted, saved prefixes reach the disk whole, and then the
        signal goes on to the handler the program had (KeyboardInterrupt for Ctrl-C)."""
        self.stop(cancel=cancel)
        # Waits on an event, not Thread.join: a join interrupted by a signal marks the
        # thread stopped while it still runs (CPython's bpo-45274 handling).
        signum = None
        with on_stop_signals(_raise_signalled):
            try:
                self._stopped.wait(timeout)
            except _Signalled as s:
                signum = s.signum
        if signum is not None:
            self._interrupted = True
            self._commands.put(("stop", ("interrupted", False)))
            self.engine.preempt()  # a document's prompt pass stops at its next graph node
            self._stopped.wait()
            signal.raise_signal(signum)
            return
        if not self._stopped.is_set():
            raise TimeoutError(f"the engine thread did not stop within {timeout} s")
        self._thread.join()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(cancel=exc_info[1] is not None)  # an exception: cancel what is in flight

    # --- the engine thread ------------------------------------------------------------
    def _run(
        self,
        profile: DeviceProfile | Literal["probe"] | None,
        limits: BackgroundLimits | None,
        ready: threading.Event,
        failed: list[BaseException],
    ) -> None:
        """The device is probed and the driver opened here, not on the caller's thread, so
        that every llama.cpp graph runs from this one thread. llama.cpp built with OpenMP
        keeps a team of worker threads for each thread that calls `llama_decode`; with a
        second team idle, libgomp counts more threads than cores and its barriers sleep
        instead of spinning: under `serve` on 2 cores each compute thread slept ~5,000 times
        a second and a one-row decode took 28-34 ms against 19 ms in `run` (history, section
        F)."""
        try:
            if profile == "probe":
                profile = probe_device(self.backend) if self.policy.required else None
            self.engine = open_driver(self.backend, self.policy, limits, profile)
            self._engine_loop = CommandLoop(
                self.engine,
                self._commands,
                self.handover,
                prefix_cache=self.backend.prefix_cache,
                recorder=self._writer,
                on_iteration=self._on_iteration,
                on_end=self._on_end,
            )
        except BaseException as e:
            failed.append(e)
            self._stopped.set()
            return
        finally:
            ready.set()
        self._drive()

    def _drive(self) -> None:
        try:
            self._engine_loop.run()
        except BaseException as e:
            self._fail(e)
        finally:
            try:
                self._finish()
            finally:
                self.handover.flush()
                self._stopped.set()

    def _fail(self, error: BaseException) -> None:
        """Mark the runtime failed and end every request it holds with the reason."""
        reason = f"the engine failed: {type(error).__name__}: {error}"
        log.error("%s; failing every request in flight", reason, exc_info=error)
        with self._lock:
            self.failure, self._closed = reason, True
        self._engine_loop.fail(reason)

    def _finish(self) -> None:
        """Save what is kept and write the summary. Each part's failure is logged, not
        raised: the thread ends either way, and the rest is still worth saving."""
        if self.backend.prefix_cache is not None:
            _attempt("save the kept prefixes", self.backend.prefix_cache.flush)
        if self._writer is not None:
            _attempt("write summary.json", self._write_summary, self._writer)
            _attempt("close the result files", self._writer.close)

    def _write_summary(self, writer: RunWriter) -> None:
        workload = {"name": "runtime", "path": None}
        meta = run_meta(
            self.backend.describe(), self.policy, self._spec, workload, failure=self.failure
        )
        now = self.engine.clock.now()
        writer.write_summary(writer.summary(meta, now, self._interrupted, 0))


def _attempt(what: str, action: Callable[..., object], *args: Any) -> None:
    try:
        action(*args)
    except Exception:
        log.exception("could not %s", what)


class _Signalled(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int) -> None:
    raise _Signalled(signum)
