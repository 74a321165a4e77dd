"""One server's pieces: the app, the engine, the prefix cache and the metrics over a loaded model (`build`), as
`triforce serve` runs it and as each Ray Serve replica (replicas.py) builds it."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import memory
from ..caches import new_cache
from ..errors import TriforceError
from ..memory import HEADROOM, gib
from ..speculation.stack import METHODS
from .prefix_cache import PrefixCache
from .stacks import StackChooser

log = logging.getLogger("triforce.serve")


def require_extra() -> None:
    try:
        import fastapi  # optional: the serve extra (fastapi, prometheus_client, uvicorn)  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise TriforceError(f"`triforce serve` needs the serve extra ({e.name} is missing): "
                            f"pip install -e '.[serve]' (or ./install.sh)") from None


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
          max_batch: int = 8, prefill_budget: int | None = None, kv_memory: int | None = None) -> Server:
    """The app over a loaded model (loading.LoadedModel) and a stack (its engine starts with the app)."""
    require_extra()
    from .app import create_app  # optional: fastapi, prometheus_client (the serve extra, checked just above)
    from .engine import Engine, EngineSettings
    from .metrics import ServerMetrics

    model = loaded.model
    prefix_cache = None
    if prefix_cache_bytes > 0:
        if model.windows is not None:
            log.warning("the prefix cache is off for models with sliding-window layers (%s): every request "
                        "prefills its whole prompt", model.cfg.arch)
        elif not hasattr(cache_type := type(new_cache(model, 1)), "read_positions"):
            # a request's cache (int8, offloaded) keeps no float K/V positions, which the prefix cache's blocks
            # are read and written as
            log.warning("the prefix cache is off with this KV cache (%s: --kv-dtype int8 or --offload-kv): every "
                        "request prefills its whole prompt (--kv-dtype fp16 or bf16 reuses prompt prefixes)",
                        cache_type.__name__)
        else:
            prefix_cache = PrefixCache(model, config.prefill_chunk, prefix_cache_bytes, kv_cache_dir)
    metrics = ServerMetrics()
    settings = EngineSettings(model, loaded.tokenizer, stack, stack_name, config, loaded.eos_token_ids, draft_model,
                              max_queue, request_timeout, max_batch, prefill_budget,
                              kv_budget(kv_memory, prefix_cache_bytes if prefix_cache is not None else 0))
    engine = Engine(settings, prefix_cache, metrics)
    model_id = model_id or default_model_id(loaded)

    page = {"stack": str(stack), "levels": [str(lvl) for lvl in stack.levels], "method": stack_name,
            "methods": list(METHODS)}
    app = create_app(engine, loaded.tokenizer, model_id=model_id, max_context=loaded.config.max_context,
                     default_max_tokens=default_max_tokens, metrics=metrics, shutdown_timeout=shutdown_timeout,
                     choose_stack=StackChooser(model, config, draft_model), page=page)
    return Server(app, engine, prefix_cache, metrics, model_id)


def kv_budget(kv_memory: int | None, prefix_cache_bytes: int) -> int | None:
    """The bytes the running requests' KV caches may take together: --kv-memory, or 90% of the memory available
    now (the model loaded) less the prefix cache's budget and memory.HEADROOM; None where the available memory is
    unknown (no limit)."""
    if kv_memory is not None:
        return kv_memory
    avail = memory.available_bytes()
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


def configure_logging(level: str) -> None:
    """The server's own log lines on stderr as `triforce: ...` (uvicorn logs its own)."""
    logger = logging.getLogger("triforce")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_triforce", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("triforce: %(message)s"))
        handler._triforce = True
        logger.addHandler(handler)
