"""Forwards of several sequences batched into one: the gate that a serving batch's requests pass their model forwards
through (serving/engine.py).

Each request runs its own generation (its own speculation stack, caches, acceptance and sampling) as a member of
the gate: a greenlet on the gate's one thread (`ForwardGate.run`), its model states running their forwards through
the gate's runner (GatedRunner, the execution/runner.ModelRunner of a request in the batch). Every model forward of
a member switches back to the gate instead of running. The gate resumes each member in turn until it waits at its
next forward or ends; when every member waits, it runs the waiting forwards, and resumes their members:

- decode-sized chains over a cache with slots (decode steps, verifications, drafting levels' forwards: what the one
  call through every layer takes, FusedDecode.layout) of one model's weights run as one forward
  (runner.forward_batch: the linear layers over every row, the weights read once; attention per request over its
  own cache). Each request's logits are bit for bit its forward's alone (kernels/decode_layer.cpp);
- any other forward (a prefill chunk, a draft tree, a quantized cache) runs alone, "solo". Solo forwards are
  interleaved with the batched ones under a token budget: a batched forward earns `prefill_budget` tokens of credit,
  and solo forwards run while the credit lasts (at least one when nothing else waits), so a long new prompt's prefill
  does not stall the others' decoding, nor do they stall it.
- among waiting solo forwards, the one whose prompt has the fewest tokens left to prefill runs first (a forward that
  is not a prefill chunk counts none left; see `prefilling`): the shortest remaining prefill first gives the lowest
  mean time to first token, so a short prompt, or one whose prefix was cached, is not kept waiting behind a long
  cold prefill, and two long prefills run one after the other rather than both finishing late. A solo forward
  passed over STARVATION times runs next whatever is left of it, so a long prompt is never starved.
- the batched forwards of a request whose first token is still to come (`first_token_due`: its prefill is done, its
  first round is not) run before any solo forward, whatever the credit: a round takes a few forwards, and waiting a
  prefill chunk before each would add seconds to that request's time to first token on a slow machine. But for a
  short prefill (at most SHORT_PREFILL tokens left, its cached blocks' restore included: a question after a cached
  document), which runs first: it costs about what the due round's forward does, and its own first round then joins
  that round's batch, so requests that arrive together start decoding together and end together, rather than the
  first one's decode steps running with fewer requests while the others prefill (8 requests at 2K, a cached document,
  128 tokens each, in process: batches of 6.64 requests on average, 7 prefills between decode steps, against 7.00,
  the most there, one request having ended at once, and none; benchmarks/batch_profile.py).

The group run is the one with the most waiting forwards (ties: the fewest rows): requests whose drafting forwards
are done wait at their verification until the others get there, so the top-level verifications of different
requests batch together (MagicDec's setting), and drafting levels over the same weights batch with each other.

Why members are greenlets on one thread, not threads: between two batched forwards each request does a little host
work (its acceptance, its sampling, its stream's next event). With a thread per request, the gate woke every
thread after each forward, and each took the gate's lock and the GIL in turn: 8 requests at 2K (`ar`, through the
server) left the gate idle 1.8-3.6 ms between forwards of 16.5-17.9 ms, of which the requests' own Python was about
0.8 ms. On one thread the members run one after the other with nothing handed over, and every forward and every
member's tensor work runs on the gate's one OpenMP team (execution/omp_threads.py: a second team slows each forward
by a third). A member must not block (a lock held for long, a sleep, a wait for another member): the whole batch
would wait with it; the engine does its waiting (for a prefix another request is prefilling) before `run`.

Which forwards share a batch changes only how fast they run, never what they compute: the output of each request is
exactly its output alone. Code that is no member of a gate runs its forwards directly (`current()` is None)."""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import greenlet
import torch

from . import runner as runners

# A prompt with at most this many tokens left to prefill (a question after a cached document) runs before the forwards
# of a request whose first token is due (the module docstring)
SHORT_PREFILL = 64
STARVATION = 16  # solo forwards that may run ahead of a waiting one (shorter prefills first) before it runs
IDLE_SECONDS = 2.0  # a gate's thread with no member for this long ends (a later member starts a new one)


class _Alone(threading.local):
    """What `prefilling` and the clocks keep for code that is no member of a gate (a thread's own)."""
    prefill_left = 0
    first_token_due = False
    seconds = None


_alone = _Alone()


class _Member(greenlet.greenlet):
    """A member of a gate: fn() run as a greenlet on the gate's thread (ForwardGate.run), with what the module's
    functions keep for it."""

    def __init__(self, gate: ForwardGate, fn, done: concurrent.futures.Future):
        super().__init__(self._body)
        self.gate, self.fn, self.done = gate, fn, done
        self.prefill_left = 0  # `prefilling`
        self.first_token_due = False  # `first_token_due`
        self.seconds = None  # its last forward's share of its batch (forward_seconds)
        self.forwards = 0.0  # its forwards' shares, summed (own_clock)
        self.cpu = 0.0  # the gate thread's CPU time while it ran, before its current turn (own_clock)
        self.resumed = 0.0  # time.thread_time() when its current turn began
        self.outcome = (None, None)  # (its result, its exception) once it has ended

    def _body(self):
        try:
            self.outcome = (self.fn(), None)
        except BaseException as e:  # noqa: BLE001 - the caller of ForwardGate.run raises it
            self.outcome = (None, e)

    def finish(self) -> None:
        """Hand its outcome to the caller of ForwardGate.run (once it has ended)."""
        result, error = self.outcome
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(result)


def _state():
    """The calling member's state, or (no member) the calling thread's."""
    g = greenlet.getcurrent()
    return g if isinstance(g, _Member) else _alone


def current() -> ForwardGate | None:
    """The gate the calling code's forwards go through (it is a member of it), or None (run them directly)."""
    g = greenlet.getcurrent()
    return g.gate if isinstance(g, _Member) else None


@contextmanager
def prefilling(tokens_left: int):
    """The caller's forwards in the block are a prefill chunk of a prompt that has `tokens_left` tokens left to
    prefill, this chunk's included (the gate's order among solo forwards)."""
    state = _state()
    state.prefill_left = tokens_left
    try:
        yield
    finally:
        state.prefill_left = 0


def first_token_due(due: bool) -> None:
    """Mark the caller's next forwards as those of a request whose first token is still to come (or no longer)."""
    _state().first_token_due = due


def forward_seconds(started: float) -> float:
    """The time of the caller's last forward, begun at `started` (perf_counter): through a gate, its share of the
    time its batch ran (`ForwardGate.batched`'s cost; not the wait for the other requests); else the time since
    `started`."""
    state = _state()
    seconds, state.seconds = state.seconds, None
    return time.perf_counter() - started if seconds is None else seconds


def own_clock() -> float:
    """A clock of the caller's own time, in seconds: a span of its work costs the clock's growth over it (the
    adaptive planner's round costs, a rebuild's cost). Off a gate, the wall clock. On one, its forwards' times
    (forward_seconds: a batched forward's share of its batch, a solo forward's whole time) plus the CPU time of its
    own turns on the gate's thread. Why not the wall clock less the waits at the gate: between its forwards a
    member also waits while the other members take their turns (and for the GIL), and each round charged that
    would carry every request's host work, N times over in a batch of N."""
    g = greenlet.getcurrent()
    if not isinstance(g, _Member):
        return time.perf_counter()
    return g.forwards + g.cpu + (time.thread_time() - g.resumed)


def exclusive(fn):
    """fn() -> its result, run by the caller or, on a gate, as a solo forward of no tokens: between batches, in the
    gate's turn order (a retrieval level's build). Why: tensor work beside the gate's forwards would share the cores
    with them, and both slow down: an 8K retrieval build took 45 ms alone and 270-580 ms (wall clock) on its
    request's thread with 8 requests at once, when requests ran on threads of their own; 26-69 ms through here."""
    gate = current()
    if gate is None:
        return fn()
    result = gate.solo(fn, 0)
    _state().seconds = None  # (its time is in own_clock; it is no forward of forward_seconds)
    return result


@dataclass(eq=False)
class _Waiting:
    key: object  # forwards with equal keys (not None) run as one batch
    rows: int
    run: object  # solo: () -> result; batched: the arguments for `batch`
    batch: object = None  # callable(list of run) -> list of results, for batched forwards
    member: _Member | None = None  # the member waiting for it
    result: object = None
    error: BaseException | None = None
    seconds: float = 0.0
    arrived: int = 0
    prefill_left: int = 0  # a solo prefill chunk: its prompt's tokens left to prefill (`prefilling`); else 0
    passed: int = 0  # solo forwards run ahead of this one while it waited
    first_token_due: bool = False  # a batched forward of a request whose first token is still to come
    cost: tuple[float, float] | None = None  # a batched forward's (shared, own) cost: see ForwardGate.batched


@dataclass
class GateStats:
    batches: int = 0  # batched forwards run
    batched_rows: int = 0  # rows they fed
    batched_requests: int = 0  # forwards they held (the batch sizes, summed)
    solo: int = 0  # forwards run alone (prefill chunks, trees, ...)
    solo_rows: int = 0
    last_batch: int = 0  # forwards in the last batched forward
    sizes: dict = field(default_factory=dict)  # batch size -> batched forwards of that size


class ForwardGate:
    def __init__(self, prefill_budget: int = 512):
        self.prefill_budget = prefill_budget
        self._cv = threading.Condition()  # guards _arriving and _thread (the rest is the gate thread's alone)
        self._arriving: list[tuple[object, concurrent.futures.Future]] = []  # members to start
        self._thread: threading.Thread | None = None  # the gate's thread (_loop), while it has work
        self._ready: collections.deque[_Member] = collections.deque()  # members to resume, in turn
        self._ended: list[_Member] = []  # members that ended in this round of turns (told after `after_turns`)
        self._waiting: list[_Waiting] = []
        self._members = 0
        self._credit = 0  # solo tokens the batched forwards have earned (see the module docstring)
        self._arrivals = 0
        self.stats = GateStats()
        self.on_batch = None  # called with (forwards, rows) after each batched forward (the server's metrics)
        # called on the gate's thread once the ready members have had their turns, before the next forward runs and
        # before an ended member's caller is told (the server's: send the events the turns produced, see
        # serving/engine.py's Engine._send)
        self.after_turns = None

    # ---- any thread -------------------------------------------------------------------------

    def submit(self, *fns) -> list[concurrent.futures.Future]:
        """Start each fn() as a member of the gate (all of them before the gate's next forward) -> a future of each
        one's result."""
        futures = [concurrent.futures.Future() for _ in fns]
        with self._cv:
            self._arriving.extend(zip(fns, futures))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="triforce-forwards", daemon=True)
                self._thread.start()
            self._cv.notify()
        return futures

    def run(self, fn):
        """fn() as a member of the gate -> its result (or its exception), once it has ended."""
        return self.submit(fn)[0].result()

    @property
    def members(self) -> int:
        """The members running now (their forwards can batch together)."""
        return self._members

    # ---- a member ---------------------------------------------------------------------------

    def solo(self, fn, rows: int):
        """Run fn() (a forward that is not batched) when the gate's turn comes -> its result."""
        return self._wait(_Waiting(None, rows, fn, prefill_left=_state().prefill_left))

    def batched(self, key, args, rows: int, batch, cost: tuple[float, float] | None = None):
        """Run `args` in one call batch([args, ...]) with the other waiting forwards of the same key -> its result.
        `cost`: (shared, own), what the forward would cost alone in any unit, split into what every forward of its
        batch shares (reading the weights) and what is its own (reading its cache, its rows' work). Each forward's
        time (forward_seconds) is then its share of the batch's: the shared part split evenly, the own parts in
        proportion. Why: a request's adaptive planner prices its routes with these times, and charged the whole
        batch, a 1-token step would cost it as much as a 6-token verification beside others' verifications, so
        every request would verify the longest drafts whatever they yield. Without a cost (or where a forward of
        the batch has none): the whole batch's time."""
        return self._wait(_Waiting(key, rows, args, batch, first_token_due=_state().first_token_due, cost=cost))

    def _wait(self, w: _Waiting):
        member = greenlet.getcurrent()
        if not isinstance(member, _Member) or member.gate is not self:
            raise RuntimeError("a gate's forwards are waited for by its members only (ForwardGate.run)")
        self._arrivals += 1
        w.arrived, w.member = self._arrivals, member
        self._waiting.append(w)
        member.parent.switch()  # (back to the gate's loop, which resumes this member once the forward has run)
        member.seconds = w.seconds
        member.forwards += w.seconds
        if w.error is not None:
            raise w.error
        return w.result

    # ---- the gate's thread ------------------------------------------------------------------

    def _loop(self) -> None:
        """Start arriving members, resume each ready one until it waits or ends, run the chosen forwards, again."""
        try:
            with torch.inference_mode():  # (every member's work is: the mode is the thread's, kept for its life)
                while self._next_arrivals():
                    while self._ready:
                        self._resume(self._ready.popleft())
                    if self.after_turns is not None:
                        self.after_turns()
                    while self._ended:
                        self._ended.pop().finish()
                    if self._waiting:
                        chosen = self._choose()
                        for w in chosen:
                            self._waiting.remove(w)
                        self._execute(chosen)
                        self._ready.extend(w.member for w in chosen)
        except BaseException as e:  # noqa: BLE001 - a bug in the gate: no member may wait for ever
            with self._cv:
                self._thread = None
                arriving, self._arriving = self._arriving, []
            members = list(self._ready) + self._ended + [w.member for w in self._waiting]
            for done in [f for _, f in arriving] + [m.done for m in members]:
                if not done.done():
                    done.set_exception(e)
            self._ready.clear()
            self._ended.clear()
            self._waiting.clear()
            self._members = 0
            raise

    def _next_arrivals(self) -> bool:
        """Take the members that arrived into the ready ones (waiting for one while there is nothing else to do);
        -> False when the thread is to end (no member for IDLE_SECONDS)."""
        with self._cv:
            while not self._arriving and not self._members:
                if not self._cv.wait(IDLE_SECONDS) and not self._arriving:
                    self._thread = None
                    return False
            arriving, self._arriving = self._arriving, []
        for fn, done in arriving:
            if done.set_running_or_notify_cancel():
                self._members += 1
                self._ready.append(_Member(self, fn, done))
        return True

    def _resume(self, member: _Member) -> None:
        member.resumed = time.thread_time()
        member.switch()
        member.cpu += time.thread_time() - member.resumed
        if member.dead:
            self._members -= 1
            self._ended.append(member)

    def _choose(self) -> list[_Waiting]:
        solo = [w for w in self._waiting if w.key is None]
        groups: dict[object, list[_Waiting]] = {}
        for w in self._waiting:
            if w.key is not None:
                groups.setdefault(w.key, []).append(w)
        due = any(w.first_token_due for g in groups.values() for w in g)
        first = min(solo, key=lambda w: (w.passed < STARVATION, w.prefill_left, w.arrived)) if solo else None
        short = first is not None and 0 < first.prefill_left <= SHORT_PREFILL
        if first is not None and (short or not due and (not groups or self._credit >= first.rows)):
            self._credit = max(0, self._credit - first.rows)
            for w in solo:
                w.passed += w is not first and w.arrived < first.arrived
            return [first]
        group = max(groups.values(), key=lambda g: (any(w.first_token_due for w in g), len(g),
                                                    -sum(w.rows for w in g), -g[0].arrived))
        if solo and not due:  # (a forward run out of turn earns no prefill credit)
            self._credit += self.prefill_budget
        return group

    def _execute(self, chosen: list[_Waiting]) -> None:
        """Run the chosen forwards (on the gate's thread, as no member: their own forwards run directly)."""
        t = time.perf_counter()
        try:
            if chosen[0].key is None:
                chosen[0].result = chosen[0].run()
            else:
                for w, r in zip(chosen, chosen[0].batch([w.run for w in chosen])):
                    w.result = r
        except Exception as e:  # noqa: BLE001 - each waiting member raises it as its own
            for w in chosen:
                w.error = e
        dt = time.perf_counter() - t
        s = self.stats
        if chosen[0].key is None:
            s.solo += 1
            s.solo_rows += chosen[0].rows
        else:
            s.batches += 1
            s.batched_rows += sum(w.rows for w in chosen)
            s.batched_requests += len(chosen)
            s.last_batch = len(chosen)
            s.sizes[len(chosen)] = s.sizes.get(len(chosen), 0) + 1
            if self.on_batch is not None:
                self.on_batch(len(chosen), sum(w.rows for w in chosen))
        for w, share in zip(chosen, _shares(chosen)):
            w.seconds = dt * share


def _shares(chosen: list[_Waiting]) -> list[float]:
    """Each forward's share of its batch's time (ForwardGate.batched's cost), or 1 each where one has no cost."""
    if len(chosen) == 1 or any(w.cost is None for w in chosen):
        return [1.0] * len(chosen)
    shared = max(w.cost[0] for w in chosen)
    total = shared + sum(w.cost[1] for w in chosen)
    return [(shared / len(chosen) + w.cost[1]) / total for w in chosen]


def _layout(model, tokens, block, cache):
    """runner.batch_layout of a forward that batches with others' (a decode-sized chain, no tree), else None."""
    return runners.batch_layout(model, tokens.shape[1], cache) if tokens.shape[0] == 1 and block is None else None


def _forward_batch(model, calls: list[tuple]) -> list:
    """runner.forward_batch over calls (tokens, cache, last, argmax) -> each call's logits, or (logits, ids) where it
    asked for the argmax (every row's in one call, where any asked)."""
    if not any(c[3] for c in calls):
        return runners.forward_batch(model, [c[:3] for c in calls])
    out = runners.forward_batch(model, [c[:3] for c in calls], argmax=True)
    return [pair if c[3] else pair[0] for pair, c in zip(out, calls)]


class GatedRunner(runners.ModelRunner):
    """The model runner of a serving batch's requests (execution/runner.py): each request, a member of `gate`
    (ForwardGate.run), runs its forwards through it. A decode-sized chain over a cache with slots waits at the gate
    and runs batched with other requests' (runner.forward_batch, the batch keyed by the model: forwards of one
    model's weights batch together); any other forward waits its turn there and runs alone."""

    def __init__(self, gate: ForwardGate):
        self.gate = gate

    def forward(self, model, tokens, cache, last=None, block=None, hidden=False, layers=None):
        if current() is not self.gate:  # (code that is no member, or the gate's loop running a forward: at once)
            return super().forward(model, tokens, cache, last, block, hidden, layers)
        layout = None if hidden or layers is not None else _layout(model, tokens, block, cache)
        if layout is None:
            return self.gate.solo(lambda: model(tokens, cache, last=last, block=block, hidden=hidden, layers=layers),
                                  tokens.shape[1])
        return self._batched(model, tokens, cache, last, layout, False)

    def forward_argmax(self, model, tokens, cache, last=None, block=None):
        """The argmax where the forward runs: a batch's over all its rows in one call. Why: per request it was one
        more tensor call per round (8 requests at 2K, `ar`, when requests ran on threads of their own: the gate's idle
        time between batched forwards 3.1 -> 2.1 ms a step, benchmarks/serve.py)."""
        if current() is not self.gate:
            return super().forward_argmax(model, tokens, cache, last, block)
        layout = _layout(model, tokens, block, cache)
        if layout is None:  # (run by the gate's loop, which is no member: there the plain runner's at once)
            return self.gate.solo(lambda: self.forward_argmax(model, tokens, cache, last, block), tokens.shape[1])
        return self._batched(model, tokens, cache, last, layout, True)

    def _batched(self, model, tokens, cache, last, layout, argmax: bool):
        T = tokens.shape[1]
        return self.gate.batched(model, (tokens, cache, T if last is None else last, argmax), T,
                                 lambda calls: _forward_batch(model, calls), cost=runners.batch_cost(model, T, layout))

    def catch_up_tokens(self, model, cache) -> int:
        """With other requests on the gate, the most tokens a forward batched with theirs takes; alone on it, 0 (a
        forward waits for nobody)."""
        return runners.batch_tokens(model, cache) if current() is self.gate and self.gate.members > 1 else 0

    def prefilling(self, tokens_left: int):
        return prefilling(tokens_left)

    def forward_seconds(self, started: float) -> float:
        return forward_seconds(started)

    def own_clock(self) -> float:
        return own_clock()

    def exclusive(self, fn):
        return exclusive(fn)
