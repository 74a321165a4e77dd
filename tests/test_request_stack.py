"""A request's own stack (the `stack` / `gammas` extension fields the web page sends), the body-size limit, and the
page's files and info served by the app: a tiny model, no browser (tests/test_web_page.py drives the page itself)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from test_serving import CONFIG, DOC, STACK, client, ext, serving, tiny, wait_for  # noqa: E402,F401
from triforce import generate  # noqa: E402
from triforce.serving.app import max_body_bytes  # noqa: E402
from triforce.serving.page import POLICY  # noqa: E402
from triforce.speculation.stack import StackSpec  # noqa: E402


def test_a_request_names_its_own_stack_and_gets_the_same_tokens(tiny):
    ids = tiny.tokenizer(DOC)["input_ids"]
    ref = generate(tiny.model, ids, 30, stack=STACK, config=CONFIG, eos_ids=tiny.eos_token_ids,
                   tokenizer=tiny.tokenizer)
    with serving(tiny) as (url, _):
        c = client(url)
        answers = {stack: c.completions.create(model="t", prompt=DOC, max_tokens=30, temperature=0,
                                               extra_body={"stack": stack, **({"gammas": gammas} if gammas else {})})
                   for stack, gammas in (("ar", None), ("ngram", None), ("ngram,retrieval:48,full", "2,3"),
                                         ("ngram", [5]))}
        server_own = c.completions.create(model="t", prompt=DOC, max_tokens=30, temperature=0)
    for stack, r in answers.items():
        assert r.choices[0].text == ref.text, stack  # lossless: every stack gives the target's tokens
    assert ext(answers["ar"])["stack"] == "full" and ext(answers["ar"])["method"] == "ar"
    assert ext(answers["ngram,retrieval:48,full"])["stack"] == "ngram,retrieval:48,full --gammas 2,3"
    assert ext(answers["ngram,retrieval:48,full"])["method"] == "ngram,retrieval:48,full"
    assert [lvl["level"] for lvl in ext(answers["ar"])["stats"]["levels"]] == ["full"]
    assert ext(server_own)["stack"] == str(STACK) and ext(server_own)["method"] == STACK.levels_text


@pytest.mark.parametrize("body,param,words", [
    ({"stack": "ngram,full,full"}, "stack", "'full' more than once"),
    ({"stack": "banana"}, "stack", "unknown level kind 'banana'"),
    ({"stack": "retrieval:99999999,full"}, "stack", "larger than the model's context"),
    ({"stack": "draft,full"}, "stack", "no draft model"),
    ({"stack": "ngram,retrieval,full", "gammas": "3,x"}, "stack", "'gammas' '3,x' must be integers"),
    ({"stack": "ngram,retrieval,full", "gammas": "1,2,3"}, "stack", "3 values for 2 boundaries"),
    ({"gammas": "3"}, "gammas", "needs 'stack'"),
    ({"stack": ""}, "stack", "a method"),
    ({"stack": 7}, "stack", "a method"),
])
def test_a_stack_that_cannot_run_here_is_a_400_naming_it(tiny, body, param, words):
    with serving(tiny) as (url, server):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
        assert server.engine.depth() == (0, 0) and httpx.get(url + "/health").json()["status"] == "ok"


def test_a_body_no_prompt_of_the_context_could_fill_is_refused_unread(tiny):
    limit = max_body_bytes(tiny.config.max_context)
    with serving(tiny) as (url, server):
        too_big = b'{"prompt": "' + b"a" * limit + b'"}'
        r = httpx.post(url + "/v1/completions", content=too_big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "fits this model's context" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: refused once it has read past the limit
            for i in range(0, len(too_big), 1 << 16):
                yield too_big[i:i + 1 << 16]
        r = httpx.post(url + "/v1/completions", content=chunked())
        assert r.status_code == 413 and "over" in r.json()["error"]["message"]
        ok = client(url).completions.create(model="t", prompt="hi", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens >= 1
        wait_for(lambda: server.engine.depth() == (0, 0))


def test_the_page_and_its_info_are_served(tiny):
    with serving(tiny) as (url, server):
        page = httpx.get(url + "/")
        files = {name: httpx.get(f"{url}/static/{name}") for name in ("page.js", "page.css", "index.html")}
        missing = httpx.get(url + "/static/secret.txt")
        info = httpx.get(url + "/page/info").json()
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and b"page.js" in page.content
    assert page.headers["content-security-policy"] == POLICY
    assert all(r.status_code == 200 for r in files.values()) and "javascript" in files["page.js"].headers["content-type"]
    assert missing.status_code == 404
    assert info["model"] == server.model_id and info["max_context"] == tiny.config.max_context
    assert info["stack"] == str(STACK) and info["levels"] == ["ngram", "retrieval:48", "full"]
    assert info["stack_choice"] and "triforce" in info["methods"] and info["max_body_bytes"] >= 1 << 20
    assert StackSpec.parse(",".join(info["levels"])).levels == STACK.levels
    json.dumps(info)


def test_the_replicas_front_end_serves_the_page_without_a_stack_choice(tiny):
    """`--replicas N`'s HTTP API (server.build_front) has the page too; a request there runs the replicas' stack, so
    the page offers no other and a request naming one is a 400."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from triforce.serving.server import build_front

    deployment = SimpleNamespace(engine=SimpleNamespace(s=SimpleNamespace(max_queue=4)), info={
        "tokenizer": tiny.tokenizer, "model_id": "tiny", "max_context": 512, "stack": str(STACK)})
    front = TestClient(build_front(deployment, default_max_tokens=8, shutdown_timeout=1.0))  # (no lifespan: no engine)
    info = front.get("/page/info").json()
    assert info["levels"] == ["ngram", "retrieval:48", "full"] and not info["stack_choice"] and info["methods"] == []
    assert front.get("/").status_code == 200
    r = front.post("/v1/completions", json={"prompt": "hi", "stack": "ar"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stack" and "--replicas" in r.json()["error"]["message"]
