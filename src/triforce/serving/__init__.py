"""`triforce serve`: an OpenAI-compatible HTTP server over one speculation engine.

    app.py           the HTTP API (FastAPI): OpenAI request parsing, responses, server-sent events
    engine.py        one engine: a FIFO queue, up to --max-batch requests at once through one ForwardGate
                     (continuous batching), one prefill per prefix, cancellation, timeouts
    prefill.py       a prompt's full-cache prefill that reuses cached prefix blocks
    prefix_cache.py  the prefix KV cache: hashed token blocks, LRU under a byte budget, on-disk copy
    prefix_blocks.py a prefix cache's block and its keys (the chain hash of its tokens, the settings it depends on)
    metrics.py       Prometheus metrics (prometheus-client)
    assembly.py      one server's pieces over a loaded model (as `triforce serve` and each replica build them)
    server.py        `triforce serve`: load the model, build the pieces, run uvicorn
    replicas.py      `triforce serve --replicas N` on Ray Serve: the deployment, the request routers
    harness.py       the server run locally for the tests and benchmarks/ (a child process, a thread, local Ray)

Everything here is optional: it needs the `serve` extra (`pip install -e '.[serve]'`).
"""
