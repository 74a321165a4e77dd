"""One engine that generates up to `max_batch` requests at once (continuous batching): requests wait in a FIFO
queue of bounded length, and each admitted request runs `generate_stream` (its own speculation stack, caches,
acceptance and sampling; the full-cache prefill reusing the prefix cache) as a member of one ForwardGate
(execution/batching.py: a greenlet on the gate's one thread), whose model forwards go through the gate: the
decode-sized forwards of every running request run as one batched forward, prefill chunks in turn under a token
budget. Each request also has a thread of its own for what would stall the batch on the gate's thread: the wait
for a prefix another request is prefilling, and the release of its caches at its end. A request joins as soon as a
place and its memory are free, and leaves when it finishes or is cancelled; the others go on.

One prefill per prefix: a request whose prompt starts with blocks that a running request is prefilling (not in
the prefix cache yet) waits, before it joins the batch, until that request has prefilled and cached them, and then
reuses them, instead of computing the same K/V beside it. A request caches its prompt's blocks as soon as its
prefill ends (before decoding).

Admission by memory: a request holds, from admission to its end, the bytes of its KV caches (`request_bytes`: its
full cache for prompt + max_tokens, its drafting levels' caches) out of `kv_budget`; one that cannot be admitted
waits in the queue, and one that could never fit (more than the whole budget) is refused when it arrives
(PromptTooLarge, a 400).

A request (`Job`) reports through `job.deliver(event)`, called on the gate's thread (Engine._send), in order:
    {"type": "delta", "text": str, "tokens": [ids], "triforce": {...}}   one per speculation round (text may be "";
                                                                        triforce: its provenance, RoundProvenance;
                                                                        the first also has "opening": {...}, how
                                                                        the prompt was read)
    {"type": "done", "finish_reason": "stop" | "length", "usage": {...}, "triforce": {...}}
or  {"type": "error", "status": int, "code": str, "message": str}   (timeout 504, shutdown 503, a bug 500)
and nothing after that. A cancelled request (client gone) gets nothing more.

Cancellation and timeouts are looked at between prefill chunks and between speculation rounds, so
a request stops within one chunk's or one round's time and the engine goes on with the next.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..caches import BufferPool, KVCache
from ..errors import TriforceError
from ..execution import batching, omp_threads
from ..execution.batching import ForwardGate, GatedRunner
from ..generate import generate_stream
from ..memory import gib, kv_bytes, kv_value_bytes
from ..model import Transformer
from ..sampling import SamplingParams
from ..speculation.builder import BuiltStack, full_capacity, max_rollback
from ..speculation.kinds import KIND_CLASSES
from ..speculation.settings import SpecConfig
from ..speculation.stack import ROUND_SLACK, StackSpec
from .metrics import ServerMetrics
from .prefill import CachedPrefill, Stopped
from .prefix_blocks import block_keys
from .prefix_cache import PrefixCache

log = logging.getLogger("triforce.serve")


class QueueFull(Exception):
    """The queue holds --max-queue requests; retry after `retry_after` seconds (an estimate)."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class PromptTooLarge(Exception):
    """A request whose KV caches need more than the server's whole KV budget: it can never run here."""

    def __init__(self, need: int, budget: int):
        super().__init__(f"the request's KV caches would take {gib(need)}, more than this server's KV budget of "
                         f"{gib(budget)} (--kv-memory): shorten the prompt or max_tokens")
        self.need, self.budget = need, budget


@dataclass(eq=False)
class Job:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    deliver: Callable[[dict], None]
    arrived: float = field(default_factory=time.perf_counter)
    deadline: float = math.inf  # perf_counter time past which the request times out
    started: float | None = None  # when the worker took it
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False
    need: int = 0  # bytes of its KV caches (request_bytes), held from admission to its end
    claim: threading.Event | None = None  # set once the prompt blocks it claimed are cached (Engine._claim_prefill)
    full_cache: KVCache | None = None  # its full cache, released when the job ends (FullCache: to the engine's pool)
    levels: BuiltStack | None = None  # its speculation levels, their caches released when the job ends (the same)
    stack: StackSpec | None = None  # its own speculation stack (the request's `stack` field); None: the server's
    stack_name: str | None = None  # that stack's name in the response (a method, or the levels)

    def __post_init__(self):
        if self.seed is None:  # OpenAI's default: a fresh draw; the seed used is reported, to reproduce it
            self.seed = secrets.randbits(31)

    def stopped(self) -> bool:
        return self.cancelled.is_set() or time.perf_counter() > self.deadline


@dataclass
class EngineSettings:
    model: Transformer
    tokenizer: object
    stack: StackSpec
    stack_name: str
    config: SpecConfig
    eos_ids: tuple[int, ...]
    draft_model: Transformer | None = None
    max_queue: int = 16
    request_timeout: float = 600.0
    max_batch: int = 8  # requests generated at once
    prefill_budget: int | None = None  # prefill tokens per batched forward (ForwardGate.prefill_budget); None: a chunk
    kv_budget: int | None = None  # bytes of KV caches the running requests may hold together (None: no limit)


# A request's full cache holds a whole number of size-class steps: 1/8 to 1/16 of its capacity (a power of two), at
# least POOL_MIN_STEP tokens. So requests of about the same length have caches of one shape and take each other's
# buffers from the engine's pool (caches.BufferPool), for at most 1/8 more memory (8K tokens: steps of 1024).
POOL_MIN_STEP = 64
# The pool's limit without a KV budget (where the available memory is unknown)
POOL_BYTES_WITHOUT_BUDGET = 2 << 30


def full_cache_tokens(prompt_tokens: int, max_tokens: int, stack: StackSpec) -> int:
    """The capacity of a request's full cache: its prompt, max_tokens and a round's lookahead, rounded up to its
    size class's step (POOL_MIN_STEP)."""
    need = max(full_capacity(prompt_tokens, max_tokens, stack),
               prompt_tokens + max_tokens + max(stack.gammas, default=0) + ROUND_SLACK)
    step = max(POOL_MIN_STEP, 1 << max(0, need.bit_length() - 4))
    return -(-need // step) * step


def request_bytes(s: EngineSettings, prompt_tokens: int, max_tokens: int, stack: StackSpec | None = None) -> int:
    """The bytes of one request's KV caches: the full cache (prompt, max_tokens and the round's lookahead, as the
    engine allocates it) in the model's KV dtype, and each drafting level's own cache as its kind makes it (a
    retrieval or H2O level's budget and the tokens appended between builds, a streaming level's window and slack,
    a draft model's whole context: Kind.cache_tokens) in config.draft_kv_dtype (memory.kv_bytes). `stack`: the
    request's own, else the server's."""
    model, stack = s.model, stack or s.stack
    capacity = full_cache_tokens(prompt_tokens, max_tokens, stack)
    total = kv_bytes(model.cfg, capacity, kv_value_bytes(model.kv_dtype))
    rollback, draft_value = max_rollback(stack), kv_value_bytes(s.config.draft_kv_dtype)
    for lvl in stack.levels[:-1]:
        tokens = KIND_CLASSES[lvl.kind].cache_tokens(s.config, lvl, rollback, capacity)
        cfg = s.draft_model.cfg if lvl.kind == "draft" and s.draft_model is not None else model.cfg
        total += kv_bytes(cfg, tokens, draft_value)
    return total


class Engine:
    def __init__(self, settings: EngineSettings, prefix_cache: PrefixCache | None = None,
                 metrics: ServerMetrics | None = None):
        self.s, self.prefix_cache, self.metrics = settings, prefix_cache, metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: dict[Job, threading.Thread] = {}
        self._held: dict[Job, int] = {}  # bytes each running request holds (request_bytes)
        self._closing = False
        self._seconds_per_job = 5.0  # moving average of a request's time, for Retry-After
        self._prefilling: dict[str, threading.Event] = {}  # block key -> set once the request prefilling it cached it
        self.gate = ForwardGate(settings.prefill_budget or settings.config.prefill_chunk)
        self.runner = GatedRunner(self.gate)  # how the requests' forwards run: through the gate, batched
        self._outbox: list[tuple[Job, dict]] = []  # the events of the members' current turns (_send)
        self.gate.after_turns = self._send_events
        self._thread = threading.Thread(target=self._admit, name="triforce-engine", daemon=True)
        # the prefix cache needs a FullCache whose blocks are contiguous slices (not a sliding-window ring)
        self._reuse = settings.model.windows is None
        # finished requests' full-cache buffers, for the next requests of their size: new ones' first touch costs
        # more than a request's start (BufferPool); kept within the KV budget (_fits evicts them for a new request)
        self.pool = BufferPool(settings.kv_budget if settings.kv_budget is not None else POOL_BYTES_WITHOUT_BUDGET)
        if metrics is not None:
            metrics.watch(lambda: len(self._queue), lambda: len(self._running),
                          prefix_cache.stats if prefix_cache is not None else None,
                          kv_usage=self.kv_usage)
            self.gate.on_batch = metrics.batch

    # ---- the API side (any thread) -----------------------------------------------------------

    def start(self) -> None:
        # The thread that loaded the model (and starts the engine) holds an OpenMP team from that work; from now on
        # the gate's thread runs every forward, and a second team would slow each of them by a third
        # (execution/omp_threads.py).
        omp_threads.release_this_thread()
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when --max-queue jobs wait already, PromptTooLarge when it could never fit in the
        KV budget, ShuttingDown after stop()."""
        job.deadline = job.arrived + self.s.request_timeout
        job.need = request_bytes(self.s, len(job.prompt), job.max_tokens, job.stack)
        if self.s.kv_budget is not None and job.need > self.s.kv_budget:
            raise PromptTooLarge(job.need, self.s.kv_budget)
        with self._cv:
            if self._closing:
                raise ShuttingDown()
            if len(self._queue) >= self.s.max_queue:
                ahead = len(self._queue) + len(self._running) + 1
                raise QueueFull(max(1, math.ceil(self._seconds_per_job * ahead / self.s.max_batch)))
            self._queue.append(job)
            self._cv.notify_all()

    def cancel(self, job: Job) -> None:
        """Forget a job (its client left): out of the queue now, or stopped at its next chunk or round."""
        job.cancelled.set()
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
                self._finished(job, "cancelled")

    def depth(self) -> tuple[int, int]:
        """(waiting, running)."""
        return len(self._queue), len(self._running)

    def kv_usage(self) -> float:
        """The fraction of the KV budget the running requests hold (0 without a budget)."""
        budget = self.s.kv_budget
        return sum(self._held.values()) / budget if budget else 0.0

    def stop(self, timeout: float = 30.0) -> None:
        """No new jobs; queued ones get a 503; the running ones are cancelled; the threads exit."""
        with self._cv:
            self._closing = True
            waiting, self._queue = list(self._queue), collections.deque()
            running = list(self._running.items())
            self._cv.notify_all()
        for job in waiting:
            self._error(job, 503, "shutting_down", "the server is shutting down: retry on another server or later")
        for job, _ in running:
            job.cancelled.set()
        deadline = time.perf_counter() + timeout
        for _, thread in running:
            thread.join(max(0.0, deadline - time.perf_counter()))
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.perf_counter()))
        if self.prefix_cache is not None:
            self.prefix_cache.close()

    # ---- admission and the request threads ---------------------------------------------------

    def _admit(self) -> None:
        """Start the queue's first job whenever a place and its memory are free (first come, first served: a job
        that does not fit yet keeps the ones behind it waiting, so a long prompt is not starved by short ones)."""
        while True:
            with self._cv:
                while not self._closing and not (self._queue and self._fits(self._queue[0])):
                    self._cv.wait()
                if self._closing:
                    return
                job = self._queue.popleft()
                self._held[job] = job.need
                thread = threading.Thread(target=self._serve, args=(job,), name="triforce-request", daemon=True)
                self._running[job] = thread
            thread.start()

    def _fits(self, job: Job) -> bool:
        if len(self._running) >= self.s.max_batch:
            return False
        budget = self.s.kv_budget
        if budget is None:
            return True
        held = sum(self._held.values())
        if held + job.need > budget:
            return False
        over = held + job.need + self.pool.bytes - budget
        if over > 0:  # the pool's buffers give way to a request's
            self.pool.evict(over)
        return True

    def _serve(self, job: Job) -> None:
        # One OpenMP thread for this thread's own work (the generation itself runs on the gate's thread): zeroing the
        # full cache's buffers for the pool, after the gate, would otherwise open a team (execution/omp_threads.py)
        with omp_threads.one_thread():
            self._serve_job(job)

    def _serve_job(self, job: Job) -> None:
        t0 = time.perf_counter()
        try:
            # outside the gate: a member that waits for anything but its forwards would stall the batch
            self._claim_prefill(job)
            self.gate.run(lambda: self._run(job))
        except TriforceError as e:  # what a request's own stack refuses at its start (stacks.py checks the rest)
            log.warning("request refused: %s", e)
            self._error(job, 400, "invalid_request", str(e))
        except Exception:  # noqa: BLE001 - a bug must not take the engine down: log it, answer 500
            log.exception("generation failed")
            self._error(job, 500, "internal_error", "internal error while generating (see the server log)")
        finally:
            self._release_prefill(job)
            # (out of the gate: zeroing the buffers for the pool takes a while)
            if job.levels is not None:
                job.levels.release()
                job.levels = None
            if job.full_cache is not None:
                job.full_cache.release()
                job.full_cache = None
            with self._cv:
                del self._running[job]
                del self._held[job]
                self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (time.perf_counter() - t0)
                self._cv.notify_all()
            _release_memory()

    def _claim_prefill(self, job: Job) -> None:
        """Wait while another running request prefills blocks that `job`'s prompt starts with and the prefix cache
        does not hold yet (until it cached them, or ended, or `job` is stopped); then claim the prompt's blocks the
        cache does not hold: requests for the same prefix wait for `job`, not for each other's uncached tails."""
        if self.prefix_cache is None or not self._reuse:
            return
        keys = block_keys(job.prompt[:-1], self.s.config.prefill_chunk)  # what CachedPrefill looks up
        job.claim = threading.Event()
        while not job.stopped():
            todo = keys[self.prefix_cache.held(keys):]  # (the cached ones are nobody's to compute)
            with self._cv:
                busy = next((self._prefilling[k] for k in reversed(todo) if k in self._prefilling), None)
                if busy is None:
                    for k in todo:
                        self._prefilling[k] = job.claim
                    return
            busy.wait(0.05)  # (in steps: a cancelled or timed-out job stops waiting)

    def _release_prefill(self, job: Job) -> None:
        """The blocks `job` claimed are cached (or it ended): the requests waiting for them go on."""
        claim = job.claim
        if claim is None or claim.is_set():
            return
        with self._cv:
            for k in [k for k, c in self._prefilling.items() if c is claim]:
                del self._prefilling[k]
        claim.set()

    def _run(self, job: Job) -> None:
        s, m = self.s, self.metrics
        job.started = time.perf_counter()
        if job.stopped():
            return self._end_stopped(job)
        capacity = full_cache_tokens(len(job.prompt), job.max_tokens, job.stack or s.stack)
        with torch.inference_mode():
            prefilled = None
            if self._reuse:
                try:
                    prefilled = CachedPrefill(s.model, job.prompt, capacity, s.config.prefill_chunk,
                                              self.prefix_cache, job.stopped, self.pool, self.runner)
                except Stopped as e:  # keep the blocks it prefilled: a retry (or the next turn) starts from them
                    p = e.partial
                    job.full_cache = p.cache
                    if self.prefix_cache is not None:
                        self.prefix_cache.insert(p.head, p.cache, p.block_queries)
                    return self._end_stopped(job)
                job.full_cache = prefilled.cache
                if m is not None and self.prefix_cache is not None:
                    (m.prefix_hits if prefilled.reused_tokens else m.prefix_misses).inc()
                    m.prefix_hit_tokens.inc(prefilled.reused_tokens)
                if m is not None:
                    m.prefilled_tokens.inc(prefilled.computed_tokens)
                if self.prefix_cache is not None:
                    # now, not after the answer: requests for this prefix wait for it (a copy of the new blocks' K/V)
                    self.prefix_cache.insert(prefilled.head, prefilled.cache, prefilled.block_queries)
                self._release_prefill(job)
            self._generate(job, prefilled)

    def _generate(self, job: Job, prefilled: CachedPrefill | None) -> None:
        s = self.s
        stream = generate_stream(s.model, job.prompt, job.max_tokens, job.params, stack=job.stack or s.stack,
                                 config=s.config, draft_model=s.draft_model, eos_ids=s.eos_ids, stop=job.stop,
                                 tokenizer=s.tokenizer, seed=job.seed, prefilled=prefilled, runner=self.runner)
        rounds = iter(stream)
        # the first chunk's provenance also says how the prompt was read (the page's panel shows it live)
        opening = {"prompt_tokens": len(job.prompt), "prefix_cache_tokens": prefilled.reused_tokens if prefilled else 0}
        try:
            first, n = self._deliver_rounds(job, rounds, opening)
        finally:
            rounds.close()  # here, not at garbage collection (on whichever thread collects it)
            job.levels = stream.levels
        if stream.result is None:  # stopped between rounds
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(job.prompt))
                self.metrics.generation_tokens.inc(n)
            return self._end_stopped(job)
        self._done(job, stream.result, first, prefilled)

    def _deliver_rounds(self, job: Job, rounds, opening: dict) -> tuple[float | None, int]:
        """Deliver each round's tokens, with their provenance (which level drafted each: the stream's `triforce`
        field; `opening` joins the first round's), until the stream ends or the job is stopped; -> (time of the
        first token or None, tokens delivered)."""
        m = self.metrics
        decode = self.s.tokenizer.decode if self.s.tokenizer is not None else None
        first = last = None
        n = 0
        batching.first_token_due(True)  # this thread's forwards until its first token: ahead of prefill chunks
        try:
            for chunk in rounds:
                now = time.perf_counter()
                if chunk.tokens:
                    if first is None:
                        first = now
                        batching.first_token_due(False)
                        if m is not None:
                            m.ttft.observe(now - job.arrived)
                    elif m is not None:
                        for _ in chunk.tokens:
                            m.itl.observe((now - last) / len(chunk.tokens))
                    last = now
                    n += len(chunk.tokens)
                extra = chunk.provenance.as_dict(decode) if chunk.provenance is not None else None
                ev = {"type": "delta", "text": chunk.text, "tokens": list(chunk.tokens), "triforce": extra}
                if extra is not None and opening:  # apart from the round's provenance, which stays --json's form
                    ev["opening"] = {**opening, "time_to_first_token": round(now - job.arrived, 4)}
                    opening = {}
                self._send(job, ev)
                if job.stopped():
                    break
        finally:
            batching.first_token_due(False)
        return first, n

    def _done(self, job: Job, res, first: float | None, prefilled: CachedPrefill | None) -> None:
        s, m = self.s, self.metrics
        finish = "length" if res.finish_reason == "length" else "stop"  # OpenAI's names: EOS and stop strings are "stop"
        if m is not None:
            m.prompt_tokens.inc(res.prompt_tokens)
            m.generation_tokens.inc(len(res.tokens))
            m.e2e.observe(time.perf_counter() - job.arrived)
            m.speculation(res.stats)
            m.finished.labels(finish).inc()
        job.finished = True
        extra = {
            "stack": str(job.stack or s.stack), "method": job.stack_name or s.stack_name, "seed": job.seed,
            "finish_reason": res.finish_reason,  # eos, stop (a stop string) or length
            "queue_seconds": round(job.started - job.arrived, 4),
            "time_to_first_token": round(first - job.arrived, 4) if first is not None else None,
            "prefill_seconds": round((prefilled.seconds if prefilled else 0.0) + res.prefill_seconds, 4),
            "prefix_cache_tokens": prefilled.reused_tokens if prefilled else 0,
            "prefilled_tokens": prefilled.computed_tokens if prefilled else res.prompt_tokens - 1,
            "decode_seconds": round(res.decode_seconds, 4),
            "tokens_per_second": round(res.tokens_per_second, 3) if res.tokens else None,
            "stats": res.stats,
        }
        self._send(job, {"type": "done", "finish_reason": finish, "triforce": extra,
                         "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.tokens),
                                   "total_tokens": res.prompt_tokens + len(res.tokens)}})

    def _send(self, job: Job, event: dict) -> None:
        """job.deliver(event); from a request's generation on the gate, once every member has had its turn, just
        before the next forward (`_send_events`). Why: each event wakes the HTTP event loop, whose work then took
        the GIL in turns with the next members' host work between two forwards; sent together before the forward,
        the loop's work runs while the forward holds no GIL."""
        if batching.current() is self.gate:
            self._outbox.append((job, event))
        else:
            job.deliver(event)

    def _send_events(self) -> None:
        """(ForwardGate.after_turns, on the gate's thread) Deliver the events of the members' turns, in order."""
        events, self._outbox = self._outbox, []
        for job, event in events:
            job.deliver(event)

    def _end_stopped(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finished(job, "cancelled")
        else:
            self._error(job, 504, "timeout", f"the request took longer than the server's --request-timeout of "
                                             f"{self.s.request_timeout:g} s")

    def _error(self, job: Job, status: int, code: str, message: str) -> None:
        if job.finished:  # nothing after a job's last event
            return
        self._finished(job, {500: "error", 504: "timeout", 503: "shutdown"}.get(status, "error"))
        self._send(job, {"type": "error", "status": status, "code": code, "message": message})

    def _finished(self, job: Job, reason: str) -> None:
        if job.finished:
            return
        job.finished = True
        if self.metrics is not None:
            self.metrics.finished.labels(reason).inc()


def _release_memory() -> None:
    """Give the freed heap of a request (its drafting caches, its other tensors) back to the OS, so that the
    server's resident memory returns to its baseline and its pool between requests: glibc keeps freed chunks below
    its adaptive mmap threshold (up to 32 MB) in the heap otherwise. A no-op without glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
