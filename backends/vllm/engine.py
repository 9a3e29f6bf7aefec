"""Replays requests through vLLM's `LLMEngine`, one `step()` at a time, as a `Driver`.

The runtime's runner submits each request when its arrival time passes on the run's clock
(vLLM's `arrival_time` only labels a request) and writes the same result files as on
llama.cpp: token timestamps come from streamed deltas as each step returns, iteration
records from the scheduler mixin once each step's completed timing has arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from edgeprefill.backends.vllm.iterations import BACKGROUND_PRIORITY, FOREGROUND_PRIORITY, class_of
from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.costs.iteration_limit import IterationLimit
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.costs.targets import FirstTokenTargets
from edgeprefill.runtime.core.driver import RunClock
from edgeprefill.runtime.core.iteration import Advance, Iteration
from edgeprefill.runtime.core.plan import Plan
from edgeprefill.runtime.core.request import (
    CLASSES,
    OutputFormat,
    Request,
    Status,
    TokenLogprob,
)


class VllmEngine:
    """One run's requests on an open vLLM engine, with `policy` installed in its scheduler."""

    def __init__(
        self,
        llm: Any,
        scheduler: Any,
        policy: BudgetPolicy,
        stop_ids: list[int],
        max_model_len: int,
        *,
        guard: Any = None,
        clock: RunClock | None = None,
        profile: DeviceProfile | None = None,
        iteration_limit: IterationLimit | None = None,
    ) -> None:
        """`iteration_limit`: how long a documents-only step may run [default: priced from
        `profile` (none without one)]; vLLM cannot stop a step a chat arrives during."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.request import RequestStatus

        self._invalid = VLLMValidationError

        self._sampling_params = SamplingParams
        self._structured_params = StructuredOutputsParams
        self._delta = RequestOutputKind.DELTA
        self._compiling = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        self.llm = llm
        self.scheduler = scheduler
        self.targets = FirstTokenTargets(profile)
        self.policy = policy
        self.clock = clock or RunClock()
        self._stop_ids = stop_ids
        self.max_model_len = max_model_len
        self._live: dict[str, Request] = {}
        self._internal: dict[str, str] = {}  # our id -> vLLM's (it appends a suffix)
        self._external: dict[str, str] = {}  # vLLM's id -> ours
        self.on_tokens: Callable[[], None] | None = None  # see `Driver.on_tokens`
        if iteration_limit is None and profile is not None:
            iteration_limit = IterationLimit(profile)
        self.iteration_limit = iteration_limit
        scheduler.install(policy, guard, self.clock.now, iteration_limit)

    @property
    def guard(self) -> Any:
        return self.scheduler.ep_planner.guard

    @guard.setter
    def guard(self, guard: Any) -> None:
        """The thermal guard caps background prompt tokens inside vLLM's scheduler."""
        self.scheduler.ep_planner.guard = guard

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def has_running(self) -> bool:
        """Some request decodes, or waits for vLLM to compile its output format's grammar
        (in a thread of vLLM's: steps schedule nothing for it until that is done)."""
        s = self.scheduler
        return bool(s.running) or any(r.status is self._compiling for r in s.waiting)

    can_preempt = False  # vLLM runs a step to its end

    def preempt(self) -> None:
        """Nothing to stop: a vLLM step is not aborted part-way."""

    def _structured(self, output_format: OutputFormat | None) -> Any:
        """vLLM's structured outputs for the format: any JSON object, or the schema."""
        if output_format is None:
            return None
        if output_format.tag is not None or output_format.or_text:  # tools take the JSON form
            raise ValueError("vLLM here holds an answer to JSON, not to tags or a reply's text")
        if output_format.schema is None:
            return self._structured_params(json_object=True)
        return self._structured_params(json=output_format.schema)

    def add(self, req: Request) -> bool:
        s = req.sampling
        params = self._sampling_params(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repeat_penalty,
            logit_bias=dict(s.logit_bias) or None,
            structured_outputs=self._structured(s.output_format),
            logprobs=s.logprobs,
            seed=None if s.greedy else s.seed,
            max_tokens=req.max_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=[] if req.ignore_eos else self._stop_ids,
            detokenize=False,
            output_kind=self._delta,
        )
        priority = FOREGROUND_PRIORITY if req.cls == "foreground" else BACKGROUND_PRIORITY
        if req.kv_cells > self.max_model_len:  # vLLM would silently cut the output short
            req.fail(
                f"prompt of {req.prompt_len} tokens plus {req.max_tokens} output tokens needs "
                f"{req.kv_cells} positions but the model runs with max_model_len "
                f"{self.max_model_len}; raise --n-ctx or shorten the prompt"
            )
            return False
        try:
            internal = self.llm.add_request(
                req.id,
                {"prompt_token_ids": req.prompt},
                params,
                arrival_time=None,
                priority=priority,
            )
        except (ValueError, self._invalid) as e:  # vLLM's own validation
            req.fail(f"vLLM refused the request: {e}")
            return False
        req.status = Status.PREFILL
        self.targets.estimate(req)
        if self.iteration_limit is not None and req.cls == "foreground":
            self.iteration_limit.saw_prompt(req.prompt_len)
        self.scheduler.ep_ttft_targets[internal] = (req.ttft_target_s, req.ttft_slowdown)
        self._live[req.id] = req
        self._internal[req.id] = internal
        self._external[internal] = req.id
        return True

    def advance(self) -> Advance | None:
        before = self.scheduler.ep_ledger.next_step
        outputs = self.llm.step()
        now = self.clock.now()
        finished: list[Request] = []
        for out in outputs:
            req = self._live.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0] if out.outputs else None
            new = list(completion.token_ids) if completion is not None else []
            cached = getattr(out, "num_cached_tokens", None)
            if cached and not req.output:  # the prompt tokens vLLM's prefix cache supplied
                req.prefix_reused_tokens = min(cached, req.prompt_len - 1)
            if new:
                req.num_computed = req.prompt_len
                req.status = Status.DECODE
                req.output += new
                req.token_times_s += [now] * len(new)
                k = req.sampling.logprobs
                if k is not None and completion is not None and completion.logprobs:
                    entries = zip(new, completion.logprobs, strict=True)
                    req.logprobs += [_logprob(t, e, k) for t, e in entries]
            if out.finished:
                reason = completion.finish_reason if completion is not None else None
                req.finish_reason = "length" if reason == "length" else "stop"
                req.status = Status.FINISHED
                del self._live[req.id]
                self.scheduler.ep_ttft_targets.pop(self._internal[req.id], None)
                finished.append(req)
        if self.on_tokens is not None:
            self.on_tokens()
        self._note_progress()
        iterations = [
            Iteration(c.record.t_start_s, self._ours(c.record.plan), c.timing, c.policy_state)
            for c in self.scheduler.take_completed()
        ]
        if not iterations and not finished and self.scheduler.ep_ledger.next_step == before:
            return None  # nothing was scheduled
        return Advance(iterations, finished)

    def _note_progress(self) -> None:
        """Prompt tokens computed so far by requests still reading their prompts, from
        vLLM's own count: a server shows a document's progress, and a question held for a
        document goes once that document's prefix is read."""
        for rid, req in self._live.items():
            if req.status is Status.PREFILL:
                held = self.scheduler.requests.get(self._internal[rid])
                if held is not None:
                    req.num_computed = min(held.num_computed_tokens, req.prompt_len)

    def _ours(self, plan: Plan) -> Plan:
        """The plan under the request ids the results use."""
        ext = self._external
        return replace(
            plan,
            decode=tuple(ext.get(r, r) for r in plan.decode),
            prefill={ext.get(r, r): n for r, n in plan.prefill.items()},
            deferred=tuple(ext.get(r, r) for r in plan.deferred),
            foreground=frozenset(ext.get(r, r) for r in plan.foreground),
        )

    def cancel(self, req: Request) -> bool:
        if self._live.pop(req.id, None) is None:
            return False
        self._end(req, "cancelled")
        return True

    def finish(self, req: Request, kept: int) -> bool:
        """See `Driver.finish`: vLLM stops it; its prefix cache keeps the blocks."""
        if self._live.pop(req.id, None) is None:
            return False
        self._end(req, None)
        req.stop_after(kept)
        return True

    def abort(self, reason: str) -> list[Request]:
        ended = list(self._live.values())
        self._live.clear()
        for req in ended:
            self._end(req, reason)
        return ended

    def queues(self) -> dict[str, tuple[int, int]]:
        s = self.scheduler
        return {
            c: (
                sum(class_of(r.priority) == c for r in s.waiting),
                sum(class_of(r.priority) == c for r in s.running),
            )
            for c in CLASSES
        }

    def _end(self, req: Request, reason: str | None) -> None:
        """Stop it in vLLM; failed with `reason` unless None (the caller ends it)."""
        internal = self._internal[req.id]
        self.scheduler.ep_ttft_targets.pop(internal, None)
        held = self.scheduler.requests.get(internal)
        if held is not None:
            req.num_computed = min(held.num_computed_tokens, req.prompt_len)
        self.llm.abort_request([internal], internal=True)
        if reason is not None:
            req.fail(reason)


def _logprob(token: int, entry: Mapping[int, Any], k: int) -> TokenLogprob:
    """vLLM's log-probabilities of one sampled token (from its raw logits, as llama.cpp's
    are read here): the token's, and those ranked 1 to k (vLLM lists the sampled token too,
    with its own rank, where it is not among them)."""
    ranked = sorted((lp.rank, t, float(lp.logprob)) for t, lp in entry.items())
    top = tuple((t, lp) for rank, t, lp in ranked if 1 <= rank <= k)
    return TokenLogprob(float(entry[token].logprob), top)
