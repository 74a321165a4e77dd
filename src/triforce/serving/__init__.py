"""`triforce serve`: an OpenAI-compatible HTTP server over one speculation engine.

    app.py           the HTTP API (FastAPI): OpenAI request parsing, responses, server-sent events
    engine.py        one engine (batch size 1): a FIFO queue, a worker thread, cancellation, timeouts
    prefill.py       a prompt's full-cache prefill that reuses cached prefix blocks
    prefix_cache.py  the prefix KV cache: hashed token blocks, LRU under a byte budget, on-disk copy
    metrics.py       Prometheus metrics (prometheus-client)
    server.py        `triforce serve`: load the model, build the pieces, run uvicorn

Everything here is optional: it needs the `serve` extra (`pip install -e '.[serve]'`).
"""
