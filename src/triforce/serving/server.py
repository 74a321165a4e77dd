"""`triforce serve`: load the model, build the prefix cache, the engine and the app, run uvicorn.

uvicorn owns SIGINT / SIGTERM here: the first one stops accepting connections, lets the running
responses finish for up to --shutdown-timeout seconds, then cancels what is left; queued requests get
a 503. (The CLI does not wrap this command in its Ctrl-C watcher, which would exit at once.)
"""
from __future__ import annotations

import logging
import signal
import socket

from ..errors import TriforceError
from ..loading import configure_device, load_model, resolve_dtype
from .assembly import build, configure_logging, require_extra

log = logging.getLogger("triforce.serve")


RAY_INSTALL = "pip install 'triforce[ray]' (or ./install.sh ray)"


def require_ray() -> None:
    """TriforceError naming what to install when Ray Serve is missing (`--replicas N`)."""
    try:
        import ray  # optional: ray (the ray extra)  # noqa: F401
        from ray import serve  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError as e:
        raise TriforceError(f"`triforce serve --replicas N` runs its replicas on Ray Serve, which is not installed "
                            f"({e.name} is missing): {RAY_INSTALL}") from None


def main(args, stack, stack_name: str, config, draft_path: str | None) -> int:
    """The `serve` command (arguments checked by the CLI)."""
    require_extra()

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
    configure_logging(args.log_level)
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
    import uvicorn  # optional: uvicorn (the serve extra)

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
    from .replicas import ReplicaSpec  # optional: ray

    load = {"rope_theta": args.rope_theta, "max_context": args.max_context, "dtype": dtype, "device": args.device,
            "cache_dir": args.cache_dir, "kv_dtype": args.kv_dtype, "weights": args.weights}
    build_kw = {"max_queue": args.max_queue, "prefix_cache_bytes": args.prefix_cache_bytes,
                "kv_cache_dir": args.kv_cache_dir, "request_timeout": args.request_timeout,
                "default_max_tokens": args.default_max_tokens, "model_id": args.served_model_name,
                "shutdown_timeout": args.shutdown_timeout, "max_batch": getattr(args, "max_batch", 8),
                "prefill_budget": getattr(args, "prefill_budget", None), "kv_memory": getattr(args, "kv_memory", None)}
    return ReplicaSpec(args.model, stack, stack_name, config, draft_path, load, build_kw,
                       threads=args.threads or args.cpus_per_replica, log_level=args.log_level)


def build_front(deployment, *, default_max_tokens: int, shutdown_timeout: float):
    """The HTTP API of `--replicas N` (app.py's) over the deployment's RayEngine."""
    from .app import create_app  # optional: fastapi, prometheus_client (the serve extra)
    from .metrics import ServerMetrics

    info = deployment.info
    levels = info["stack"].split(" ")[0]  # (str(StackSpec): the levels, then the gammas)
    page = {"stack": info["stack"], "levels": levels.split(","), "method": levels, "methods": []}  # (no stack choice)
    return create_app(deployment.engine, info["tokenizer"], model_id=info["model_id"],
                      max_context=info["max_context"], default_max_tokens=default_max_tokens,
                      metrics=ServerMetrics(), shutdown_timeout=shutdown_timeout, page=page)


def _serve_replicas(args, stack, stack_name: str, config, draft_path: str | None, dtype) -> int:
    """`triforce serve --replicas N`: the deployment on Ray Serve, the HTTP API here."""
    from . import replicas as ray_replicas  # optional: ray

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
