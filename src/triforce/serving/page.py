"""The web page at `/` of `triforce serve`: a prompt box, the answer streamed with every token marked by the level that
drafted it, and a live panel (static/: index.html, page.js, page.css; no build step, nothing fetched from elsewhere).

The page reads the same OpenAI-compatible stream as any client (/v1/chat/completions or /v1/completions with
"stream": true); each chunk's `triforce` field carries its round's provenance (speculation/provenance.py). Stop
aborts the fetch: the server sees the connection close and cancels the request (app.py's _EventStream).

Its files are read once, from the package, and served with a Content-Security-Policy that allows this server only,
so the page works without a network and cannot load anything from elsewhere.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
         "page.css": "text/css; charset=utf-8"}
# this server only: scripts, styles and requests; an image only as data (the empty favicon)
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def read_files() -> dict[str, bytes]:
    static = resources.files(__package__).joinpath("static")
    return {name: static.joinpath(name).read_bytes() for name in FILES}


def add_page(app: FastAPI, info: dict) -> None:
    """GET / (the page), GET /static/{index.html, page.js, page.css}, and GET /page/info: `info`, what the page shows
    of this server (the model's id and context, its stack, the methods a request may name, the largest body it
    reads)."""
    files = read_files()

    def serve(name: str) -> Response:
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    async def page():
        return serve("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            return JSONResponse({"error": {"message": f"no such file: /static/{name}", "type": "not_found_error",
                                           "param": None, "code": None}}, status_code=404)
        return serve(name)

    @app.get("/page/info", include_in_schema=False)
    async def page_info():
        return info
