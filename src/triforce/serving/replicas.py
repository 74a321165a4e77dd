"""`triforce serve --replicas N`: N engines on Ray Serve behind one OpenAI-compatible endpoint.

    this process      the HTTP API (app.py, unchanged) over a `RayEngine`: it parses and tokenizes each
                      request, names the prompt's prefix-cache blocks (their chain hashes) and sends the
                      request to the deployment through a Ray Serve handle; the handle's request router
                      (PrefixAffinityRouter or RoundRobinRouter, below) picks the replica
    Ray Serve         the `triforce` deployment: N replicas (Ray actors, on any node of the cluster), each
                      one Engine with its own prefix cache, streaming the engine's events back

Routing by prefix: a replica reports the keys of the blocks its prefix cache holds (Ray Serve's
`record_routing_stats`, every second); the router counts, per replica, how many of the request's
leading block keys it holds (the blocks it would reuse: the same chain hashes, the same block size)
plus the blocks of requests the router sent it and that are still running or ended less than
OPTIMISTIC_SECONDS ago (not reported yet). The replica that holds the most wins, unless it has more
than `balance` requests more in flight than the least loaded one: then the least loaded.

A choice counts at once: Ray Serve probes the chosen replica's queue (an await) before it reports the
request routed, so requests arriving together would all see the same empty replicas and pile onto
one. The router therefore names one replica first and reserves it for the request (its load and its
blocks) until Ray reports where the request went (or RESERVE_SECONDS pass).

A replica that dies: Ray Serve starts another. A request that had received nothing from it is sent
again (to another replica, up to `attempts` times); one that had streamed part of its answer ends
with a 503 error `replica_died` (retry it). Needs Ray Serve: `pip install 'triforce[ray]'`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import ray
import torch
from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from ..loading import load_model
from .assembly import build, configure_logging
from .engine import Job, QueueFull, ShuttingDown
from .prefix_blocks import block_keys, leading

log = logging.getLogger("triforce.serve")

DEPLOYMENT = "triforce"
OPTIMISTIC_SECONDS = 10.0  # a sent request's blocks count as held this long after it ends (then the report rules)
STATS_PERIOD = 1.0  # seconds between a replica's reports of its cached blocks
RESERVE_SECONDS = 5.0  # a choice not yet reported routed (Ray probing, retrying) counts this long


@dataclass
class ReplicaSpec:
    """What a replica needs to build its engine (as `triforce serve` would, in one process)."""

    model: str | None
    stack: object  # StackSpec
    stack_name: str
    config: object  # SpecConfig
    draft_path: str | None = None
    load: dict = field(default_factory=dict)  # load_model's keyword arguments
    build: dict = field(default_factory=dict)  # assembly.build's keyword arguments
    threads: int | None = None
    log_level: str = "info"


class TriforceReplica:
    """One replica: an Engine over the loaded model; `generate` streams its events."""

    def __init__(self, spec: ReplicaSpec):
        if spec.threads:
            torch.set_num_threads(spec.threads)
        configure_logging(spec.log_level)
        loaded = load_model(spec.model, progress=False, **spec.load)
        draft = None
        if spec.draft_path is not None and any(lvl.kind == "draft" for lvl in spec.stack.levels):
            draft = load_model(spec.draft_path, progress=False, max_context=loaded.config.max_context,
                               **{k: v for k, v in spec.load.items() if k in ("dtype", "device", "cache_dir", "weights")}
                               ).model
        self.server = build(loaded, spec.stack, spec.stack_name, spec.config, draft_model=draft, **spec.build)
        self.engine = self.server.engine
        self.engine.start()
        self.loaded = loaded
        try:
            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (a test calling the class directly)
            self.name = f"pid{os.getpid()}"
        self.node = ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else None
        log.info("replica %s ready (pid %d, %d threads)", self.name, os.getpid(), torch.get_num_threads())

    def info(self) -> dict:
        """What the front end needs: the tokenizer, the served id, the context, the block size."""
        pc = self.server.prefix_cache
        return {"tokenizer": self.loaded.tokenizer, "model_id": self.server.model_id,
                "max_context": self.loaded.config.max_context, "block_size": pc.block_size if pc else None,
                "max_queue": self.engine.s.max_queue, "stack": str(self.engine.s.stack)}

    async def generate(self, request: dict):
        """Stream the engine's events for one request (see engine.py), each naming the replica
        (`replica`; the final one in its `triforce` field too, with the Ray node's id). Cancelled
        (the client left): the job is cancelled."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(request["prompt"], request["max_tokens"], request["params"], request["seed"],
                  tuple(request["stop"]), lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            self.engine.submit(job)
        except QueueFull as e:
            yield {"type": "error", "status": 429, "code": "queue_full", "retry_after": e.retry_after,
                   "message": f"the replica is busy; retry after {e.retry_after} s"}
            return
        except ShuttingDown:
            yield {"type": "error", "status": 503, "code": "shutting_down", "message": "the replica is shutting down"}
            return
        try:
            while True:
                ev = await events.get()
                ev["replica"] = self.name
                if ev["type"] == "done":
                    ev["triforce"]["replica"], ev["triforce"]["replica_node"] = self.name, self.node
                yield ev
                if ev["type"] != "delta":
                    return
        finally:
            if not job.finished:
                self.engine.cancel(job)

    def record_routing_stats(self) -> dict:
        """Ray Serve asks every STATS_PERIOD s: the keys of the cached blocks, and the queue."""
        pc = self.server.prefix_cache
        waiting, running = self.engine.depth()
        return {"blocks": pc.keys() if pc is not None else [], "time": time.time(), "waiting": waiting,
                "running": running}

    def check_health(self) -> None:
        if not self.engine._thread.is_alive():
            raise RuntimeError("the engine's worker thread is gone")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(5.0)


# ---- the request routers (they run in the front end's process, one per handle) ---------------------

def _blocks_of(pending: PendingRequest | None) -> list[str]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    return pending.args[0].get("blocks") or []


class _CountingRouter(RequestRouter):
    """Counts the requests it has in flight on each replica (its view of the load), and the ones it
    has chosen a replica for that Ray has not reported routed yet (reservations)."""

    def initialize_state(self, **kwargs):
        self.in_flight: dict[ReplicaID, int] = {}
        self._requests: dict[str, tuple[ReplicaID, list[str]]] = {}
        self._reserved: dict[str, tuple[ReplicaID, list[str], float]] = {}  # request -> (replica, blocks, when)

    def reserve(self, pending_request, replica: RunningReplica) -> None:
        """Count `pending_request` on `replica` now, before Ray reports it routed (choices made in the
        meantime see it); a later choice for the same request replaces this one."""
        if pending_request is not None:
            self._reserved[pending_request.metadata.internal_request_id] = (
                replica.replica_id, _blocks_of(pending_request), time.monotonic())

    def reservations(self, replica_id: ReplicaID) -> list[list[str]]:
        """The blocks of each live reservation on `replica_id` (expired ones dropped)."""
        now = time.monotonic()
        for rid in [rid for rid, (_, _, t) in self._reserved.items() if now - t > RESERVE_SECONDS]:
            del self._reserved[rid]
        return [keys for rid, (where, keys, _) in self._reserved.items() if where == replica_id]

    def load(self, replica: RunningReplica) -> int:
        return self.in_flight.get(replica.replica_id, 0) + len(self.reservations(replica.replica_id))

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._reserved.pop(pending_request.metadata.internal_request_id, None)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self._requests[pending_request.metadata.internal_request_id] = (replica_id, _blocks_of(pending_request))

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        if self._requests.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id):
        self.in_flight.pop(replica_id, None)
        for rid in [rid for rid, (where, _, _) in self._reserved.items() if where == replica_id]:
            del self._reserved[rid]
        super().on_replica_actor_died(replica_id)

    def least_loaded_ranks(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Ranks of equal load, the least loaded first (within a rank: `tie_break`, then at random)."""
        by_load: dict[int, list[RunningReplica]] = {}
        for r in candidates:
            by_load.setdefault(self.load(r), []).append(r)
        ranks = []
        for load in sorted(by_load):
            rank = by_load[load]
            random.shuffle(rank)
            keys = {r.replica_id: self.tie_break(r) for r in rank}
            least = min(keys.values())
            ranks.append([r for r in rank if keys[r.replica_id] == least])
            if len(ranks[-1]) < len(rank):
                ranks.append([r for r in rank if keys[r.replica_id] != least])
        return ranks

    def tie_break(self, replica: RunningReplica) -> int:
        return 0


class RoundRobinRouter(_CountingRouter):
    """Each request to the next replica in turn (by replica id), whatever it holds."""

    def initialize_state(self, **kwargs):
        super().initialize_state(**kwargs)
        self._turn = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not order:
            return []
        first = self._turn % len(order)
        self._turn += 1
        return [[r] for r in order[first:] + order[:first]]


class PrefixAffinityRouter(_CountingRouter):
    """To the replica that holds the longest run of the request's leading prefix-cache blocks
    (reported by the replicas, or sent there lately), unless its load exceeds the least loaded
    replica's by more than `balance` requests; else the least loaded (of those, the one caching the
    fewest blocks)."""

    def initialize_state(self, balance: int = 4, **kwargs):
        super().initialize_state(**kwargs)
        self.balance = balance
        self._sent: dict[ReplicaID, dict[str, float]] = {}  # key -> when its request ended (inf: running)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        sent = self._sent.setdefault(replica_id, {})
        for key in _blocks_of(pending_request):
            sent[key] = float("inf")

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        entry = self._requests.get(internal_request_id)
        super().on_request_completed(replica_id, internal_request_id)
        if entry is not None:
            sent, now = self._sent.setdefault(replica_id, {}), time.monotonic()
            for key in entry[1]:
                sent[key] = now

    def on_replica_actor_died(self, replica_id):
        self._sent.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def claimed(self, replica: RunningReplica) -> set[str]:
        """The block keys `replica` holds as far as the router knows: reported by the replica, sent to it
        lately (OPTIMISTIC_SECONDS after their request ended) or reserved on it."""
        sent, now = self._sent.get(replica.replica_id, {}), time.monotonic()
        for stale in [k for k, t in sent.items() if now - t > OPTIMISTIC_SECONDS]:
            del sent[stale]
        keys = set((replica.routing_stats or {}).get("blocks") or ()) | set(sent)
        for reserved in self.reservations(replica.replica_id):
            keys.update(reserved)
        return keys

    def tie_break(self, replica: RunningReplica) -> int:
        """Between equally loaded replicas, a new prefix goes to the one caching the fewest blocks
        (the most room: documents spread over the replicas' caches rather than pile up on one)."""
        return len(self.claimed(replica))

    def held(self, replica: RunningReplica, keys: list[str]) -> int:
        """How many of `keys` (a prompt's blocks, root first) the replica holds, from the first on."""
        return leading(keys, self.claimed(replica))

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        """-> ranks of replicas to try, the first a single replica, reserved for the request."""
        keys = _blocks_of(pending_request)
        if not candidate_replicas:
            return []
        least = min(self.load(r) for r in candidate_replicas)
        held = {r.replica_id: self.held(r, keys) for r in candidate_replicas} if keys else {}
        best = max(held.values(), default=0)
        holders = [r for r in candidate_replicas
                   if best > 0 and held[r.replica_id] == best and self.load(r) - least <= self.balance]
        if holders:
            holders.sort(key=self.load)
            rest = [r for r in candidate_replicas if r not in holders]
            rest.sort(key=lambda r: (-held[r.replica_id], self.load(r)))
            order = holders + rest
        else:
            order = [r for rank in self.least_loaded_ranks(candidate_replicas) for r in rank]
        self.reserve(pending_request, order[0])
        return [[r] for r in order]


ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter}


# ---- the front end's engine ----------------------------------------------------------------------

class _Stopping(Exception):
    """A replica answered that it is shutting down before it started the request."""


class RayEngine:
    """The Engine interface that app.py uses (start, submit, cancel, depth, stop, s.max_queue), over
    the deployment's handle: a job runs on a replica; its events come back through `job.deliver`."""

    def __init__(self, handle, block_size: int | None, max_queue: int, attempts: int = 3):
        self.handle = handle.options(stream=True)
        self.block_size = block_size
        self.s = SimpleNamespace(max_queue=max_queue)
        self.attempts = attempts
        self._tasks: dict[object, asyncio.Task] = {}
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.retried = 0  # requests sent again after their replica died (tests read it)

    def start(self) -> None:
        pass

    def submit(self, job) -> None:
        if self._closing:
            raise ShuttingDown()
        if len(self._tasks) >= self.s.max_queue:
            raise QueueFull(5)
        self._loop = asyncio.get_running_loop()
        self._tasks[job] = self._loop.create_task(self._drive(job))

    def cancel(self, job) -> None:
        job.cancelled.set()
        task = self._tasks.get(job)
        if task is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(task.cancel)

    def depth(self) -> tuple[int, int]:
        return 0, len(self._tasks)

    def stop(self, timeout: float = 30.0) -> None:
        self._closing = True
        for job in list(self._tasks):
            self.cancel(job)

    def _request(self, job) -> dict:
        blocks = block_keys(job.prompt, self.block_size) if self.block_size else []
        return {"prompt": job.prompt, "max_tokens": job.max_tokens, "params": job.params, "seed": job.seed,
                "stop": list(job.stop), "blocks": blocks}

    async def _drive(self, job) -> None:
        request = self._request(job)
        try:
            for attempt in range(1, self.attempts + 1):
                streamed = False
                response = self.handle.generate.remote(request)
                try:
                    async for ev in response:
                        if ev["type"] == "error" and ev.get("code") == "shutting_down" and not streamed:
                            raise _Stopping()  # a replica being replaced or scaled down: another one
                        if ev["type"] == "delta":
                            streamed = True
                        job.deliver(ev)
                        if ev["type"] != "delta":
                            return
                    raise RuntimeError("the replica's stream ended without a last event")
                except asyncio.CancelledError:
                    response.cancel()
                    raise
                except RayTaskError:
                    log.exception("a replica failed while answering")
                    return self._error(job, 500, "internal_error", "internal error on a replica (see its log)")
                except (RayError, RuntimeError, _Stopping) as e:
                    if streamed:
                        return self._error(job, 503, "replica_died",
                                           f"the replica answering this request stopped mid-answer "
                                           f"({type(e).__name__}); retry the request (Ray Serve replaces the replica)")
                    log.warning("a replica stopped before answering (%s); sending the request again (%d/%d)",
                                type(e).__name__, attempt, self.attempts)
                    self.retried += 1
                    await asyncio.sleep(0.2 * attempt)
            self._error(job, 503, "replica_died", f"{self.attempts} replicas in a row stopped before answering this "
                                                  f"request; retry it later")
        finally:
            self._tasks.pop(job, None)

    @staticmethod
    def _error(job, status: int, code: str, message: str) -> None:
        job.deliver({"type": "error", "status": status, "code": code, "message": message})


# ---- deploying ------------------------------------------------------------------------------------

@dataclass
class Deployment:
    handle: object
    info: dict
    engine: RayEngine
    owns_serve: bool  # this process started Serve (and Ray): shut both down at the end

    def close(self) -> None:
        try:
            if self.owns_serve:
                serve.shutdown()
            else:
                serve.delete(DEPLOYMENT)
        finally:
            if self.owns_serve:
                ray.shutdown()


def init_ray(address: str | None, *, num_cpus: int | None = None, runtime_env: dict | None = None) -> bool:
    """Connect to the cluster at `address`, or start a local Ray instance (no dashboard, loopback);
    -> whether this process started it."""
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    kw = {"include_dashboard": False, "log_to_driver": True, "runtime_env": runtime_env or None}
    if address:
        # Ray turns token authentication on by itself for `auto` only; `ray start --head` made a token
        # (~/.ray/auth_token, or RAY_AUTH_TOKEN): present it to an explicit address too
        if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN")
                                                  or (Path.home() / ".ray" / "auth_token").exists()):
            os.environ["RAY_AUTH_MODE"] = "token"
        ray.init(address=address, **kw)
        return False
    ray.init(num_cpus=num_cpus, object_store_memory=256 << 20, _node_ip_address="127.0.0.1", **kw)
    return True


def deploy(spec: ReplicaSpec, replicas: int, *, cpus_per_replica: float, routing: str = "prefix",
           max_queue: int = 16, owns_serve: bool = True, balance: int = 4) -> Deployment:
    """Run the deployment (Ray must be initialised) and wait for its replicas; -> the handle."""
    serve.start(proxy_location="Disabled")
    router = RequestRouterConfig(request_router_class=ROUTERS[routing],
                                 request_router_kwargs={"balance": balance} if routing == "prefix" else {},
                                 request_routing_stats_period_s=STATS_PERIOD,
                                 request_routing_stats_timeout_s=10.0)
    app = serve.deployment(TriforceReplica, name=DEPLOYMENT, num_replicas=replicas,
                           max_ongoing_requests=max_queue + 1, ray_actor_options={"num_cpus": cpus_per_replica},
                           health_check_period_s=5.0, health_check_timeout_s=30.0,
                           graceful_shutdown_timeout_s=10.0, request_router_config=router).bind(spec)
    handle = serve.run(app, name=DEPLOYMENT, route_prefix=None)
    info = handle.info.remote().result()
    engine = RayEngine(handle, info["block_size"], max_queue * replicas)
    return Deployment(handle, info, engine, owns_serve)
