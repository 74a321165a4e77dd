"""`triforce serve`: load the model, build the prefix cache, the engine and the app, run uvicorn.

uvicorn owns SIGINT / SIGTERM here: the first one stops accepting connections, lets the running
responses finish for up to --shutdown-timeout seconds, then cancels what is left; queued requests get
a 503. (The CLI does not wrap this command in its Ctrl-C watcher, which would exit at once.)
"""
from __future__ import annotations

import logging
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import TriforceError

log = logging.getLogger("triforce.serve")


def _require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TriforceError(f"`triforce serve` needs the serve extra ({e.name} is missing): "
                            f"pip install -e '.[serve]' (or ./install.sh)") from None


RAY_INSTALL = "pip install 'triforce[ray]' (or ./install.sh ray)"


def require_ray() -> None:
    """TriforceError naming what to install when Ray Serve is missing (`--replicas N`)."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError as e:
        raise TriforceError(f"`triforce serve --replicas N` runs its replicas on Ray Serve, which is not installed "
                            f"({e.name} is missing): {RAY_INSTALL}") from None


@dataclass
class Server:
    """What `build` made: the app and the pieces behind it (tests and the load test reach in)."""

    app: object
    engine: object
    prefix_cache: object
    metrics: object
    model_id: str


def build(loaded, stack, stack_name: str, config, *, draft_model=None, max_queue: int = 16,
          prefix_cache_bytes: int = 2 << 30, kv_cache_dir=None, request_timeout: float = 600.0,
          default_max_tokens: int = 256, model_id: str | None = None, shutdown_timeout: float = 30.0,
          max_batch: int = 8, prefill_budget: int = 512, kv_memory: int | None = None) -> Server:
    """The app over a loaded model (loading.LoadedModel) and a stack (its engine starts with the app)."""
    _require_extra()
    from .app import create_app
    from .engine import Engine, EngineSettings
    from .metrics import ServerMetrics
    from .prefix_cache import PrefixCache

    model = loaded.model
    prefix_cache = None
    if prefix_cache_bytes > 0:
        if model.windows is not None:
            log.warning("the prefix cache is off for models with sliding-window layers (%s): every request "
                        "prefills its whole prompt", model.cfg.arch)
        else:
            prefix_cache = PrefixCache(model, config.prefill_chunk, prefix_cache_bytes, kv_cache_dir)
    metrics = ServerMetrics()
    settings = EngineSettings(model, loaded.tokenizer, stack, stack_name, config, loaded.eos_token_ids, draft_model,
                              max_queue, request_timeout, max_batch, prefill_budget,
                              kv_budget(kv_memory, prefix_cache_bytes if prefix_cache is not None else 0))
    engine = Engine(settings, prefix_cache, metrics)
    model_id = model_id or default_model_id(loaded)
    app = create_app(engine, loaded.tokenizer, model_id=model_id, max_context=loaded.config.max_context,
                     default_max_tokens=default_max_tokens, metrics=metrics, shutdown_timeout=shutdown_timeout)
    return Server(app, engine, prefix_cache, metrics, model_id)


def kv_budget(kv_memory: int | None, prefix_cache_bytes: int) -> int | None:
    """The bytes the running requests' KV caches may take together: --kv-memory, or 90% of the memory available
    now (the model loaded) less the prefix cache's budget and memory.HEADROOM; None where the available memory is
    unknown (no limit)."""
    from ..memory import HEADROOM, available_bytes, gib

    if kv_memory is not None:
        return kv_memory
    avail = available_bytes()
    if avail is None:
        return None
    budget = int(0.9 * (avail - prefix_cache_bytes - HEADROOM))
    if budget <= 0:
        raise TriforceError(f"no memory left for requests' KV caches: {gib(avail)} available, of which "
                            f"--prefix-cache-bytes takes {gib(prefix_cache_bytes)}: lower --prefix-cache-bytes or "
                            f"give --kv-memory")
    return budget


def default_model_id(loaded) -> str:
    if loaded.gguf_path is not None and "embedded" in loaded.source:
        return "SmolLM2-135M-Instruct"
    return Path(loaded.source).stem if loaded.source else "model"


def _configure_logging(level: str) -> None:
    """The server's own log lines on stderr as `triforce: ...` (uvicorn logs its own)."""
    logger = logging.getLogger("triforce")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_triforce", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("triforce: %(message)s"))
        handler._triforce = True
        logger.addHandler(handler)


def main(args, stack, stack_name: str, config, draft_path: str | None) -> int:
    """The `serve` command (arguments checked by the CLI)."""
    _require_extra()
    from ..loading import configure_device, load_model, resolve_dtype

    if args.kv_dtype == "int8":  # its prefix cache stores and restores float K/V blocks
        raise TriforceError("triforce serve does not support --kv-dtype int8 yet (its prefix cache holds float K/V "
                            "blocks): use fp32, bf16 or fp16, or triforce generate / bench with int8")
    if getattr(args, "offload_kv", False):
        raise TriforceError("triforce serve does not support --offload-kv yet (its prefix cache copies K/V blocks "
                            "on the GPU): use triforce generate or bench with --offload-kv")
    replicas = getattr(args, "replicas", 1)
    if replicas > 1:
        require_ray()
    dtype = resolve_dtype(args)  # a missing GPU is refused here, before the port and the model
    try:  # before the model loads: a busy port is said in a second, not after a minute
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as e:
        raise TriforceError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}): pick another --port "
                            f"or --host") from None
    _configure_logging(args.log_level)
    if replicas > 1:
        return _serve_replicas(args, stack, stack_name, config, draft_path, dtype)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=True, kv_dtype=args.kv_dtype,
                        weights=args.weights)
    configure_device(loaded.model, args)
    draft_model = None
    if any(lvl.kind == "draft" for lvl in stack.levels):
        draft_model = load_model(draft_path, dtype=dtype, device=args.device, cache_dir=args.cache_dir,
                                 max_context=loaded.config.max_context, progress=True, weights=args.weights).model
    server = build(loaded, stack, stack_name, config, draft_model=draft_model, max_queue=args.max_queue,
                   prefix_cache_bytes=args.prefix_cache_bytes, kv_cache_dir=args.kv_cache_dir,
                   request_timeout=args.request_timeout, default_max_tokens=args.default_max_tokens,
                   model_id=args.served_model_name, shutdown_timeout=args.shutdown_timeout,
                   max_batch=args.max_batch, prefill_budget=args.prefill_budget, kv_memory=args.kv_memory)
    cache = (f"prefix cache {args.prefix_cache_bytes / 2**30:g} GiB" + (f" in {args.kv_cache_dir}" if args.kv_cache_dir
                                                                      else " (in memory)")
             if server.prefix_cache is not None else "no prefix cache")
    budget = server.engine.s.kv_budget
    log.info("serving %s as %r on http://%s:%d/v1 (stack %s; %s; batch %d; queue %d; KV budget %s)", loaded.source,
             server.model_id, args.host, args.port, stack, cache, args.max_batch, args.max_queue,
             "unlimited" if budget is None else f"{budget / 2**30:.2f} GiB")
    return _run_uvicorn(server.app, args)


def _run_uvicorn(app, args) -> int:
    import uvicorn

    config_ = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                             timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.access_log)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully: SIGINT then ends as
    # Ctrl-C does everywhere (exit code 130), SIGTERM (a service manager's stop) as a clean exit, 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config_).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def replica_spec(args, stack, stack_name: str, config, draft_path: str | None, dtype):
    """What each replica of `triforce serve --replicas N` loads and builds (the same as one server)."""
    from .replicas import ReplicaSpec

    load = {"rope_theta": args.rope_theta, "max_context": args.max_context, "dtype": dtype, "device": args.device,
            "cache_dir": args.cache_dir, "kv_dtype": args.kv_dtype, "weights": args.weights}
    build_kw = {"max_queue": args.max_queue, "prefix_cache_bytes": args.prefix_cache_bytes,
                "kv_cache_dir": args.kv_cache_dir, "request_timeout": args.request_timeout,
                "default_max_tokens": args.default_max_tokens, "model_id": args.served_model_name,
                "shutdown_timeout": args.shutdown_timeout, "max_batch": getattr(args, "max_batch", 8),
                "prefill_budget": getattr(args, "prefill_budget", 512), "kv_memory": getattr(args, "kv_memory", None)}
    return ReplicaSpec(args.model, stack, stack_name, config, draft_path, load, build_kw,
                       threads=args.threads or args.cpus_per_replica, log_level=args.log_level)


def build_front(deployment, *, default_max_tokens: int, shutdown_timeout: float):
    """The HTTP API of `--replicas N` (app.py's) over the deployment's RayEngine."""
    from .app import create_app
    from .metrics import ServerMetrics

    info = deployment.info
    return create_app(deployment.engine, info["tokenizer"], model_id=info["model_id"],
                      max_context=info["max_context"], default_max_tokens=default_max_tokens,
                      metrics=ServerMetrics(), shutdown_timeout=shutdown_timeout)


def _serve_replicas(args, stack, stack_name: str, config, draft_path: str | None, dtype) -> int:
    """`triforce serve --replicas N`: the deployment on Ray Serve, the HTTP API here."""
    from . import replicas as ray_replicas

    spec = replica_spec(args, stack, stack_name, config, draft_path, dtype)
    where = f"the Ray cluster at {args.ray_address}" if args.ray_address else "a local Ray instance"
    log.info("starting %d replicas (%g CPUs, %d threads each; routing %s) on %s", args.replicas,
             args.cpus_per_replica, spec.threads, args.routing, where)
    try:
        owns = ray_replicas.init_ray(args.ray_address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise TriforceError(f"cannot reach the Ray cluster at {args.ray_address}: {e}") from None
    deployment = None
    try:
        deployment = ray_replicas.deploy(spec, args.replicas, cpus_per_replica=args.cpus_per_replica,
                                         routing=args.routing, max_queue=args.max_queue, owns_serve=owns)
        app = build_front(deployment, default_max_tokens=args.default_max_tokens,
                          shutdown_timeout=args.shutdown_timeout)
        log.info("serving %r from %d replicas on http://%s:%d/v1 (stack %s; %s routing)", deployment.info["model_id"],
                 args.replicas, args.host, args.port, deployment.info["stack"], args.routing)
        return _run_uvicorn(app, args)
    finally:
        if deployment is not None:
            deployment.close()
        elif owns:
            ray_replicas.ray.shutdown()
