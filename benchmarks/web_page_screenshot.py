"""The web page's screenshot from a long prompt: a real `triforce serve` on the embedded model with its default stack,
the prompt dropped on the page as a text file, a greedy answer generated from the page, then the page saved as PNG.

    PYTHONPATH=src python benchmarks/web_page_screenshot.py [--tokens 32000] [--max-tokens 128] [--out PATH]
    e.g. PYTHONPATH=src python benchmarks/web_page_screenshot.py --out docs/web_page_32k.png

The document is the start of the demo corpus (`triforce generate --demo-tokens`' text), cut to `--tokens` tokens
with the question after it; with the chat template the prompt is a few tokens more. The browser is the browser
tests' (tests/test_web_page.py: headless Chromium under Selenium, networking blocked but for the loopback address),
so it needs what they need (`./install.sh ci`). A 32K-token prefill takes from under two minutes on an idle 2-core
machine to most of an hour on one shared with other jobs: the server's request timeout and the wait here are two
hours. Prints the figures the page shows, from the response's last chunk.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from triforce.serving.harness import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_web_page import fill, marked_tokens, missing_step, open_page, panel_levels, start_chromium, status, \
    verify_counts, wait  # noqa: E402

QUESTION = "Who speaks the first line of the text above, and what does he ask?"
PATIENCE = 7200  # seconds: the server's request timeout, and how long the page may take to answer


def document(n_tokens: int) -> str:
    """The demo corpus' first `n_tokens` tokens as text, then the question."""
    from triforce.corpus import demo_tokens
    from triforce.loading import load_model

    tokenizer = load_model(progress=False).tokenizer  # (the embedded model's, found as the server finds it)
    return tokenizer.decode(demo_tokens(tokenizer, n_tokens)) + "\n\n" + QUESTION


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32000, help="the document's tokens (default 32000)")
    ap.add_argument("--max-tokens", type=int, default=128, help="the answer's length at most (default 128)")
    ap.add_argument("--window", default="1400,1050", help="the browser window, width,height (default 1400,1050)")
    ap.add_argument("--out", default="docs/web_page_32k.png", help="the screenshot (default docs/web_page_32k.png)")
    args = ap.parse_args()
    if (step := missing_step()) is not None:
        print(f"web_page_screenshot: {step}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = Path(tmp) / "document.txt"
        prompt_file.write_text(document(args.tokens), encoding="utf-8")
        # `triforce serve` with its defaults (the embedded model, the adaptive triforce stack), once it answers
        server = ServerProcess(["--request-timeout", str(PATIENCE)], Path(tmp) / "serve.log")
        url = server.url
        browser = None
        try:
            browser = start_chromium(args.window)
            open_page(browser, url)
            browser.find_element("id", "file").send_keys(str(prompt_file))  # as a file dropped on the box
            wait(lambda: browser.find_element("id", "file-note").text, 60, "the file to be read")
            fill(browser, None, max_tokens=args.max_tokens)  # the server's stack, greedy, the chat template
            started = time.monotonic()
            browser.find_element("id", "run").click()
            wait(lambda: status(browser).startswith(("done", "stopped", "error")), PATIENCE, "the answer")
            print(f"page: {status(browser)} after {time.monotonic() - started:.0f} s", file=sys.stderr)
            assert status(browser).startswith("done"), f"the page did not finish the answer: {status(browser)}"
            final = json.loads(browser.find_element("id", "stats").get_attribute("textContent"))
            assert panel_levels(browser) == verify_counts(final["stats"]), "the panel is not the server's stats"
            browser.execute_script("window.scrollTo(0, 0)")
            assert browser.save_screenshot(args.out), "no screenshot"
            tokens = marked_tokens(browser)
            prompt_tokens = int(browser.find_element("id", "prompt-tokens").text)
        finally:
            if browser is not None:
                browser.quit()
            server.stop()
    print(json.dumps({
        "screenshot": args.out, "prompt_tokens": prompt_tokens,
        "answer_tokens": len(tokens), "tokens_by_level": dict(Counter(t["level"] for t in tokens)),
        **{k: final[k] for k in ("stack", "time_to_first_token", "prefill_seconds", "prefix_cache_tokens",
                                 "decode_seconds", "tokens_per_second", "finish_reason")},
        "verify": {lvl["level"]: {k: lvl.get(k) for k in ("rounds", "proposed", "accepted", "acceptance_rate",
                                                          "tokens_per_round")}
                   for lvl in final["stats"]["levels"] if lvl["role"] == "verify"},
        "adaptive": {k: v for k, v in (final["stats"].get("adaptive") or {}).items()
                     if k in ("routes", "route_changes", "final_route")},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
