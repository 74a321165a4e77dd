"""`triforce serve --replicas N` on Ray Serve: the CLI without Ray, the request routers' choices, and
one local Ray instance (loopback only, 2 replicas of 1 thread each, the embedded model) behind the
HTTP API: prefix-affinity routing (the same-prefix request goes to the replica that holds it, its time
to first token at least 5x shorter than a cold one's), answers equal to `triforce generate`'s, and a
replica killed mid-load (a request it had not started streaming is answered by the other; the one
it was streaming ends with a clear, retryable error; Ray replaces the replica)."""
from __future__ import annotations

import asyncio
import collections
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from triforce import cli
from triforce.serving.prefix_blocks import block_keys, chain_hash

pytest.importorskip("fastapi")


# ---- without Ray ---------------------------------------------------------------------------------

def test_replicas_without_ray_name_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is missing
    assert cli.main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'triforce[ray]'" in err and "Traceback" not in err
    assert cli.main(["serve", "--routing", "round-robin"]) == 2  # a replica option without --replicas
    assert "apply to --replicas N" in capsys.readouterr().err


def test_block_keys_are_the_prefix_caches_lookup_keys():
    tokens = list(range(100))
    keys = block_keys(tokens, 32)
    assert len(keys) == 3  # whole blocks only
    parent = None
    for i, key in enumerate(keys):
        parent = chain_hash(parent, tuple(tokens[i * 32:(i + 1) * 32]))
        assert key == parent
    assert block_keys(tokens[:31], 32) == []


# ---- the routers' choices (no cluster: fake replicas) ---------------------------------------------

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from triforce.serving import replicas as R  # noqa: E402

FakeID = collections.namedtuple("FakeID", "unique_id")


def fake_replica(name: str, blocks=()):
    return SimpleNamespace(replica_id=FakeID(name), routing_stats={"blocks": list(blocks)},
                           max_ongoing_requests=16)


def router(cls, **kw):
    r = object.__new__(cls)  # the routing logic alone: RequestRouter.__init__ wants a running Serve
    r.initialize_state(**kw)
    return r


def pending(blocks, request_id="r"):
    return SimpleNamespace(args=[{"blocks": list(blocks)}], kwargs={},
                           metadata=SimpleNamespace(internal_request_id=request_id))


def choose(r, replicas, blocks):
    """The ranks `r` would try for a request of `blocks` (its reservation dropped: a question only)."""
    ranks = asyncio.run(r.choose_replicas(replicas, pending(blocks, "question")))
    r._reserved.pop("question", None)
    return [[x.replica_id.unique_id for x in rank] for rank in ranks]


def test_prefix_router_prefers_the_longest_held_prefix_unless_load_is_uneven():
    a, b = fake_replica("a", ["k1"]), fake_replica("b", ["k1", "k2", "k3"])
    r = router(R.PrefixAffinityRouter, balance=2)
    assert choose(r, [a, b], ["k1", "k2", "k3", "k4"])[0] == ["b"]
    assert choose(r, [a, b], ["k1", "x2"])[0] in (["a"], ["b"])  # both hold 1 block: a tie
    # b busy by more than `balance` requests: the least loaded replica instead
    for i in range(3):
        r.on_request_routed(pending([], f"busy{i}"), b.replica_id, None)
    assert choose(r, [a, b], ["k1", "k2", "k3"])[0] == ["a"]
    for i in range(3):
        r.on_request_completed(b.replica_id, f"busy{i}")
    assert choose(r, [a, b], ["k1", "k2", "k3"])[0] == ["b"]


def test_prefix_router_counts_what_it_sent_before_the_replica_reports_it():
    a, b = fake_replica("a"), fake_replica("b")
    r = router(R.PrefixAffinityRouter)
    r.on_request_routed(pending(["d1", "d2"], "first"), a.replica_id, None)  # running on a, not reported yet
    assert choose(r, [a, b], ["d1", "d2", "q"])[0] == ["a"]
    r.on_request_completed(a.replica_id, "first")
    assert choose(r, [a, b], ["d1", "d2", "q"])[0] == ["a"]  # ended just now: a report is due
    r._sent[a.replica_id] = {k: time.monotonic() - R.OPTIMISTIC_SECONDS - 1 for k in ("d1", "d2")}
    assert r.held(a, ["d1", "d2", "q"]) == 0  # stale and unreported: a holds nothing as far as the router knows


def test_prefix_router_puts_a_new_prefix_on_the_replica_with_the_most_room():
    a, b = fake_replica("a", ["x1", "x2", "x3"]), fake_replica("b", ["y1"])
    r = router(R.PrefixAffinityRouter)
    assert choose(r, [a, b], ["new1", "new2"]) == [["b"], ["a"]]  # equal load: b caches fewer blocks
    r.on_request_routed(pending([], "busy"), b.replica_id, None)
    assert choose(r, [a, b], ["new1", "new2"]) == [["a"], ["b"]]  # load first


def test_prefix_router_spreads_requests_chosen_together_before_ray_reports_them():
    """Ray Serve reports a request routed only after probing the replica's queue (an await), so
    requests arriving together are chosen before any is reported: each choice must count at once."""
    a, b = fake_replica("a"), fake_replica("b")
    r = router(R.PrefixAffinityRouter)
    docs = [[f"doc{d}-{i}" for i in range(3)] for d in range(4)]
    firsts = [asyncio.run(r.choose_replicas([a, b], pending(docs[d], f"req{d}")))[0] for d in range(4)]
    assert all(len(rank) == 1 for rank in firsts)  # one replica named first (the one reserved)
    names = [rank[0].replica_id.unique_id for rank in firsts]
    assert sorted(names) == ["a", "a", "b", "b"]  # four new documents: two on each
    # the same document again, still not reported routed: where its first request was reserved
    again = asyncio.run(r.choose_replicas([a, b], pending(docs[0] + ["q"], "req0-again")))[0][0]
    assert again.replica_id.unique_id == names[0]
    # Ray reports req0 routed to the other replica (its probe found the first full): counted there
    other = b if names[0] == "a" else a
    r.on_request_routed(pending(docs[0], "req0"), other.replica_id, None)
    assert "req0" not in r._reserved and r.in_flight[other.replica_id] == 1
    # a reservation Ray never reports (a cancelled request) stops counting after RESERVE_SECONDS
    rid, (where, keys, _) = next(iter(r._reserved.items()))
    r._reserved[rid] = (where, keys, time.monotonic() - R.RESERVE_SECONDS - 1)
    r.reservations(where)
    assert rid not in r._reserved


def test_round_robin_router_takes_turns():
    a, b = fake_replica("a", ["k1"]), fake_replica("b")
    r = router(R.RoundRobinRouter)
    firsts = [choose(r, [b, a], ["k1"])[0][0] for _ in range(4)]
    assert firsts == ["a", "b", "a", "b"]


# ---- the front end's re-send (no cluster: a fake handle whose replicas die on cue) ----------------

class _DyingHandle:
    """A deployment handle whose n-th call's replica dies after sending `sent[n]` events (None: it answers)."""

    def __init__(self, sent: list[int | None]):
        self.sent, self.calls = sent, 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        dies_after = self.sent[self.calls]
        self.calls += 1

        class Response:
            def cancel(self):
                pass

            async def __aiter__(self):
                events = [{"type": "delta", "text": "a", "tokens": [1]}, {"type": "delta", "text": "b", "tokens": [2]},
                          {"type": "done", "finish_reason": "length", "usage": {}, "triforce": {}}]
                for i, ev in enumerate(events):
                    if dies_after is not None and i == dies_after:
                        raise ray.exceptions.ActorDiedError()
                    yield ev

        return Response()


def _drive(sent: list[int | None]) -> tuple[list[dict], R.RayEngine]:
    from triforce.sampling import SamplingParams
    from triforce.serving.engine import Job

    events = []
    engine = R.RayEngine(_DyingHandle(sent), block_size=None, max_queue=4)

    async def go():
        engine.submit(Job([1, 2, 3], 2, SamplingParams(), 0, (), events.append))
        while engine._tasks:
            await asyncio.sleep(0.01)

    asyncio.run(go())
    return events, engine


def test_front_end_sends_again_a_request_whose_replica_died_before_answering():
    events, engine = _drive([0, 0, None])  # two replicas die before their first event, the third answers
    assert [e["type"] for e in events] == ["delta", "delta", "done"] and engine.retried == 2
    events, engine = _drive([0, 0, 0])  # three in a row: a retryable error, no answer
    assert [e.get("code") for e in events] == ["replica_died"] and events[0]["status"] == 503


def test_front_end_ends_with_replica_died_when_the_replica_died_mid_answer():
    events, engine = _drive([1, None])  # one token streamed, then the replica died: not sent again
    assert [e["type"] for e in events] == ["delta", "error"] and events[1]["code"] == "replica_died"
    assert engine.retried == 0 and engine.handle.calls == 1


# ---- a local Ray instance: 2 replicas, 1 thread each -----------------------------------------------

from conftest import embedded_available  # noqa: E402
from triforce.serving.harness import (  # noqa: E402
    documents,
    kill_replica,
    local_cluster,
    question,
    stream_one,
    wait_healthy,
)

BLOCK = 128
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    """A local Ray (2 CPUs, loopback) with the deployment of 2 replicas of 1 thread, and the HTTP API."""
    if not embedded_available():
        pytest.skip("the embedded model is not installed (./install.sh)")
    with local_cluster(routing="prefix", replicas=2, threads=1, prefill_chunk=BLOCK, max_tokens=MAX_TOKENS,
                       max_queue=8) as c:
        yield c
    assert not ray.is_initialized()  # nothing left running


@pytest.fixture(scope="module")
def reference(cluster):
    """`triforce generate`'s greedy answer (one thread, as each replica), computed in this process."""
    from triforce import SamplingParams, generate
    from triforce.loading import load_model

    loaded = load_model(None, max_context=4096, progress=False)
    threads = torch.get_num_threads()
    answers = {}

    def answer(ids: list[int]):
        key = tuple(ids)
        if key not in answers:
            torch.set_num_threads(1)
            try:
                answers[key] = generate(loaded.model, ids, MAX_TOKENS, SamplingParams(), stack=cluster.stack,
                                        config=cluster.config, eos_ids=loaded.eos_token_ids,
                                        tokenizer=loaded.tokenizer, seed=0)
            finally:
                torch.set_num_threads(threads)
        return answers[key]

    return answer


def _stream(url: str, ids: list[int]) -> dict:
    out = stream_one(url, ids, MAX_TOKENS)
    assert out["status"] == 200 and out["error"] is None, out
    return out


def test_same_prefix_goes_to_the_replica_that_holds_it_and_answers_equal_generate(cluster, reference):
    tok = cluster.tokenizer
    docs = documents(tok, 2, 1100)
    # a cold request per document: the second goes to the other replica (the first is still running
    # or its replica holds a prefix the second does not share: the least loaded one)
    cold = [_stream(cluster.url, doc + question(tok, 0)) for doc in docs]
    warm = [_stream(cluster.url, doc + question(tok, 1)) for doc in docs]
    for c, w, doc in zip(cold, warm, docs):
        assert c["triforce"]["prefix_cache_tokens"] == 0
        assert w["triforce"]["replica"] == c["triforce"]["replica"], (c["triforce"], w["triforce"])
        assert w["triforce"]["prefix_cache_tokens"] >= len(doc) // BLOCK * BLOCK
    for r, doc, q in [(c, d, 0) for c, d in zip(cold, docs)] + [(w, d, 1) for w, d in zip(warm, docs)]:
        assert r["text"] == reference(doc + question(tok, q)).text


def test_a_replica_killed_mid_load_loses_no_request_that_had_not_streamed(cluster, reference):
    """Four questions on one document: prefix affinity puts them on one replica, one running and three queued
    (a replica answers one request at a time). That replica is killed when the first streams: its queued requests
    are sent again and answered by the other replica (equal to generate's), the one it was streaming ends with
    `replica_died` or had finished; Ray starts a new replica."""
    from triforce import SamplingParams
    from triforce.serving.engine import Job

    tok, engine = cluster.tokenizer, cluster.deployment.engine
    (doc,) = documents(tok, 1, 700)
    prompts = [doc + question(tok, q) for q in range(2, 6)]

    async def run() -> list[dict]:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in prompts]
        for ids, q in zip(prompts, queues):
            engine.submit(Job(ids, MAX_TOKENS, SamplingParams(), 0, (),
                              lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev)))
        outcomes = [{"tokens": [], "replicas": set(), "end": None} for _ in prompts]
        killed = None

        async def follow(i: int) -> None:
            nonlocal killed
            while outcomes[i]["end"] is None:
                ev = await queues[i].get()
                outcomes[i]["replicas"].add(ev.get("replica"))
                if ev["type"] == "delta":
                    outcomes[i]["tokens"] += ev["tokens"]
                    if killed is None and ev["tokens"]:
                        killed = ev["replica"]
                        kill_replica(killed)
                        outcomes[i]["killed_while_streaming"] = True
                else:
                    outcomes[i]["end"] = ev

        await asyncio.wait_for(asyncio.gather(*(follow(i) for i in range(len(prompts)))), 600)
        return outcomes, killed

    outcomes, killed = asyncio.run(run())
    assert killed is not None
    died = [o for o in outcomes if o["end"]["type"] == "error"]
    answered = [(o, ids) for o, ids in zip(outcomes, prompts) if o["end"]["type"] == "done"]
    assert len(died) + len(answered) == len(prompts)
    for o in died:  # only requests that had streamed from the killed replica
        assert o["end"]["code"] == "replica_died" and o["end"]["status"] == 503 and o["tokens"]
        assert o["replicas"] >= {killed} and "retry" in o["end"]["message"]
    # the request that was streaming when the kill was sent ends with replica_died, or (the kill takes effect a
    # moment later) finishes on that replica first: either way nothing else came from the killed replica
    (streaming,) = [o for o in outcomes if o.get("killed_while_streaming")]
    assert streaming in died or streaming["end"]["type"] == "done"
    for o, ids in answered:
        assert o["tokens"] == reference(ids).tokens
        assert o["end"]["triforce"]["replica"] != killed or o is streaming
    # the ones queued for it were answered by the other replica: sent again by our front end (engine.retried) or,
    # when Ray Serve had not dispatched them yet, routed there by Ray itself; none is lost either way
    moved = [o for o, _ in answered if o is not streaming]
    assert moved and all(o["end"]["triforce"]["replica"] != killed for o in moved)
    # Ray replaces the replica: the deployment has 2 running replicas again
    wait_healthy(2, seconds=120)
    # ...and serves: a request after the replacement is answered
    again = _stream(cluster.url, prompts[0])
    assert again["text"] == reference(prompts[0]).text
