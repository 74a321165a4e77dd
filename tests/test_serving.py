"""`triforce serve`: the OpenAI API through the real `openai` client against a server on 127.0.0.1,
the prefix cache (reuse, exactness, LRU, persistence, refused files), the queue, cancellation and
metrics. A tiny random model with a character tokenizer for most; one test with the embedded model."""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from conftest import embedded_available, hf_tiny, ours_from_hf  # noqa: E402
from triforce import SamplingParams, generate  # noqa: E402
from triforce.serving.harness import uvicorn_thread  # noqa: E402
from triforce.loading import LoadedModel  # noqa: E402
from triforce.serving import engine as engine_module  # noqa: E402
from triforce.serving.prefix_cache import PrefixCache  # noqa: E402
from triforce.serving.assembly import build  # noqa: E402
from triforce.speculation.settings import SpecConfig  # noqa: E402
from triforce.speculation.stack import StackSpec  # noqa: E402
from triforce.caches import new_cache

# Small blocks (the prefill chunk) so that a few-hundred-token prompt spans many; a retrieval level
# small enough to be used (not skipped) on such prompts.
CONFIG = SpecConfig(prefill_chunk=16, recent=16, chunk_size=8)
STACK = StackSpec.parse("ngram,retrieval:48,full", "3,4")
DOC = "The quick brown fox jumps over the lazy dog; the dog sleeps on. " * 3  # ~190 tokens


def char_tokenizer(vocab_size: int = 128):
    """One token per character (printable ASCII and newline), ChatML-like specials, a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    toks = ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(i) for i in range(32, 127)] + ["\n"]
    toks += [f"<x{i}>" for i in range(vocab_size - len(toks))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(toks)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


@pytest.fixture(scope="module")
def tiny():
    tok = char_tokenizer()
    model = ours_from_hf(hf_tiny("llama", seed=1, vocab_size=len(tok)))
    return LoadedModel(model, tok, model.cfg, "tiny", Path("."))


def reference(loaded, ids, max_tokens, params=SamplingParams(), seed=0, stop=()):
    """What `triforce generate` computes for the same prompt, stack, settings and seed."""
    return generate(loaded.model, ids, max_tokens, params, stack=STACK, config=CONFIG, eos_ids=loaded.eos_token_ids,
                    tokenizer=loaded.tokenizer, seed=seed, stop=stop)


@contextlib.contextmanager
def serving(loaded, stack=STACK, config=CONFIG, **kw):
    """A server on 127.0.0.1 (a free port) in a thread; yields (base url, the built Server)."""
    server = build(loaded, stack, stack.levels_text, config, **kw)
    with uvicorn_thread(server.app) as url:
        yield url, server


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def ext(obj) -> dict:
    """The response's `triforce` extension field."""
    return obj.model_extra["triforce"]


def test_completions_equal_generate_and_reuse_the_prefix(tiny):
    tok = tiny.tokenizer
    with serving(tiny) as (url, server):
        c = client(url)
        first = c.completions.create(model="tiny", prompt=DOC + "Q1", max_tokens=40, temperature=0)
        second = c.completions.create(model="tiny", prompt=DOC + "Q2?", max_tokens=40, temperature=0)
        sampled = [c.completions.create(model="x", prompt=DOC + "Q3", max_tokens=30, temperature=0.8, top_p=0.9,
                                        seed=7, extra_body={"top_k": 20}) for _ in range(2)]
        models = c.models.list()
    ids1, ids2 = tok(DOC + "Q1")["input_ids"], tok(DOC + "Q2?")["input_ids"]
    ref1, ref2 = reference(tiny, ids1, 40), reference(tiny, ids2, 40)
    assert first.choices[0].text == ref1.text and second.choices[0].text == ref2.text
    assert first.usage.prompt_tokens == len(ids1) and first.usage.completion_tokens == len(ref1.tokens)
    assert first.choices[0].finish_reason == ("length" if ref1.finish_reason == "length" else "stop")
    # the second prompt reused the first's whole blocks (a multiple of the block size) and prefilled the rest
    shared = len(DOC) + 1  # characters = tokens here: the DOC and "Q"
    assert ext(first)["prefix_cache_tokens"] == 0
    assert ext(second)["prefix_cache_tokens"] == shared // 16 * 16
    assert ext(second)["prefilled_tokens"] == len(ids2) - 1 - shared // 16 * 16
    assert [lvl["level"] for lvl in ext(first)["stats"]["levels"]] == ["full", "retrieval:48", "ngram"]
    ref3 = reference(tiny, tok(DOC + "Q3")["input_ids"], 30, SamplingParams(0.8, 0.9, 20), seed=7)
    assert sampled[0].choices[0].text == sampled[1].choices[0].text == ref3.text  # seeded: reproducible, = generate's
    assert ext(sampled[1])["seed"] == 7 and ext(sampled[1])["prefix_cache_tokens"] > 0
    assert [m.id for m in models.data] == [server.model_id]


def test_chat_and_streaming(tiny):
    tok = tiny.tokenizer
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": DOC}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]
    ref = reference(tiny, ids, 48)
    with serving(tiny) as (url, _):
        c = client(url)
        whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0)
        chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        pieces = list(c.completions.create(model="tiny", prompt=DOC, max_tokens=48, temperature=0, stream=True))
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": DOC, "max_tokens": 8, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert whole.choices[0].message.content == ref.text and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(texts) >= 3 and "".join(texts) == ref.text  # several chunks, together the whole answer
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(ref.tokens) and not chunks[-1].choices
    assert ext(chunks[-2])["stats"]["stack"] == STACK.levels_text
    assert "".join(p.choices[0].text for p in pieces) == reference(tiny, tok(DOC)["input_ids"], 48).text
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_streamed_chunks_carry_each_rounds_provenance(tiny):
    """Each streamed chunk's `triforce` field holds its round's tokens, the level that drafted each and their texts:
    together generate()'s token ids and the answer's text, their verifications summed the final stats' counts."""
    from triforce.speculation.provenance import level_counts

    ids = tiny.tokenizer(DOC)["input_ids"]
    ref = reference(tiny, ids, 48)
    with serving(tiny) as (url, _):
        chunks = list(client(url).completions.create(model="tiny", prompt=DOC, max_tokens=48, temperature=0,
                                                      stream=True))
    rounds = [ext(c) for c in chunks if "tokens" in ext(c)]
    final = ext(chunks[-1])
    assert [t["id"] for r in rounds for t in r["tokens"]] == ref.tokens
    assert "".join(t["text"] for r in rounds for t in r["tokens"]) == "".join(c.choices[0].text for c in chunks)
    assert level_counts(rounds) == {lvl["level"]: {k: lvl[k] for k in ("rounds", "proposed", "accepted")}
                                    for lvl in final["stats"]["levels"] if lvl["role"] == "verify"}
    assert {t["level"] for r in rounds for t in r["tokens"]} <= {"full", "retrieval:48", "ngram"}
    assert rounds[0]["prompt_tokens"] == len(ids) and rounds[0]["prefix_cache_tokens"] == 0


def json_rounds(loaded, ids, max_tokens):
    """`triforce generate --json`'s `rounds` for the same prompt, stack and settings (greedy): each round's
    provenance, as commands/generate.py collects it."""
    from triforce.generate import generate_stream

    stream = generate_stream(loaded.model, ids, max_tokens, stack=STACK, config=CONFIG, eos_ids=loaded.eos_token_ids,
                             tokenizer=loaded.tokenizer)
    return [chunk.provenance.as_dict(loaded.tokenizer.decode) for chunk in stream]


def test_a_whole_response_carries_the_answers_rounds(tiny):
    """A non-streamed response's `triforce` field has the whole answer's provenance (`rounds`): the streamed chunks'
    concatenated (less the first's note of how the prompt was read, which the whole response has at its top) and
    `--json`'s `rounds`, for the same greedy request; completions and chat alike."""
    tok = tiny.tokenizer
    messages = [{"role": "user", "content": DOC}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]
    with serving(tiny, prefix_cache_bytes=0) as (url, _):  # (each request prefills its whole prompt, as --json)
        c = client(url)
        whole = c.completions.create(model="tiny", prompt=DOC, max_tokens=48, temperature=0)
        chunks = list(c.completions.create(model="tiny", prompt=DOC, max_tokens=48, temperature=0, stream=True))
        chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0)
    streamed = [ext(ch) for ch in chunks if "tokens" in ext(ch)]
    opening = ("prompt_tokens", "prefix_cache_tokens", "time_to_first_token")
    assert all(key in streamed[0] for key in opening) and "rounds" not in ext(chunks[-1])
    assert ext(whole)["rounds"] == [{k: v for k, v in r.items() if k not in opening} for r in streamed]
    assert ext(whole)["rounds"] == json_rounds(tiny, tok(DOC)["input_ids"], 48)
    assert ext(chat)["rounds"] == json_rounds(tiny, chat_ids, 48)
    assert "".join(t["text"] for r in ext(chat)["rounds"] for t in r["tokens"]) == chat.choices[0].message.content
    assert any(t["level"] != "full" for r in ext(whole)["rounds"] for t in r["tokens"])  # (drafted tokens among them)


def test_bad_requests_get_400_naming_the_field(tiny):
    with serving(tiny, max_queue=2) as (url, _):
        def post(body, path="/v1/completions"):
            r = httpx.post(url + path, content=body if isinstance(body, bytes) else json.dumps(body))
            return r.status_code, r.json()["error"]

        cases = [(b"{not json", None), (b"[1, 2]", None), ({"prompt": "hi", "n": 2}, "n"),
                 ({"prompt": "hi", "logit_bias": {"5": 3}}, "logit_bias"), ({"prompt": "hi", "wibble": 1}, "wibble"),
                 ({"prompt": "hi", "max_tokens": 0}, "max_tokens"), ({"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
                 ({"prompt": "hi", "temperature": "hot"}, "temperature"), ({"prompt": "hi", "top_p": 2}, "top_p"),
                 ({"prompt": "hi", "stop": 5}, "stop"), ({"prompt": ["a", "b"]}, "prompt"), ({}, "prompt"),
                 ({"prompt": [1, 10 ** 6]}, "prompt"), ({"prompt": [-1, 2]}, "prompt"),
                 ({"prompt": "hi", "stream_options": {"include_usage": True}},
                                                         "stream_options")]
        for body, param in cases:
            status, err = post(body)
            assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        for body in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                     {"messages": [{"role": "user", "content": 3}]}):
            status, err = post(body, "/v1/chat/completions")
            assert status == 400 and err["param"] == "messages", err
        status, err = post({"prompt": "x" * 600})
        assert status == 400 and err["code"] == "context_length_exceeded"
        assert httpx.get(url + "/v1/nothing").status_code == 404
        assert httpx.get(url + "/v1/completions").status_code == 405
        with pytest.raises(openai.BadRequestError, match="only n=1"):
            client(url).completions.create(model="tiny", prompt="hi", n=2)
        ok = client(url).completions.create(model="tiny", prompt="hi", max_tokens=3, presence_penalty=0, logprobs=None)
        assert ok.usage.completion_tokens >= 1  # neutral values of unsupported fields are fine
        assert httpx.get(url + "/health").json()["status"] == "ok"


def test_metrics_agree_with_the_responses(tiny):
    from prometheus_client.parser import text_string_to_metric_families

    with serving(tiny) as (url, _):
        c = client(url)
        responses = [c.completions.create(model="tiny", prompt=DOC + q, max_tokens=32, temperature=t, seed=1)
                     for q, t in (("A", 0), ("B", 0), ("C", 0.7))]
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 3})
        text = httpx.get(url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    for name, field in (("triforce:spec_decode_num_draft_tokens_total", "proposed"),
                        ("triforce:spec_decode_num_accepted_tokens_total", "accepted"),
                        ("triforce:spec_decode_num_drafts_total", "rounds")):
        for level in ("full", "retrieval:48"):
            expected = sum(lvl[field] for r in responses for lvl in ext(r)["stats"]["levels"] if lvl["level"] == level)
            assert value(name, level=level) == expected, (name, level)
    assert value("triforce:spec_decode_num_draft_tokens_total", level="full") > 0
    assert value("triforce:generation_tokens_total") == sum(r.usage.completion_tokens for r in responses)
    assert value("triforce:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in responses)
    assert value("triforce:time_to_first_token_seconds_count") == 3
    assert value("triforce:requests_total", endpoint="/v1/completions", status="200") == 3
    assert value("triforce:requests_total", endpoint="/v1/completions", status="400") == 1
    assert value("triforce:prefix_cache_hits_total") == 2 and value("triforce:prefix_cache_misses_total") == 1
    assert value("triforce:prefix_cache_hit_tokens_total") == sum(ext(r)["prefix_cache_tokens"] for r in responses)
    assert value("triforce:prefix_cache_bytes") > 0


def test_prefix_cache_evicts_least_recently_used_leaves(tiny):
    model = tiny.model
    cache = PrefixCache(model, 16, 1 << 30)

    def insert(tokens):
        kv = new_cache(model, len(tokens) + 4, record_queries=True)
        with torch.inference_mode():
            model(torch.tensor([tokens]), kv)
        q = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, model.cfg.head_dim)
        return cache.insert(tokens, kv, {i: q for i in range(len(tokens) // 16)})

    a, b = list(range(3, 51)), list(range(3, 35)) + [60] * 16  # 3 blocks each, sharing 2
    assert insert(a) == 3
    per_block = cache.bytes // 3
    cache.budget = 5 * per_block
    assert insert(b) == 1 and cache.bytes == 4 * per_block
    assert len(cache.lookup(b)) == 3  # b's leaf is now the newest
    assert insert(list(range(70, 102))) == 2  # 6 blocks > 5: a's leaf (least recently used) goes
    assert len(cache.lookup(a)) == 2 and len(cache.lookup(b)) == 3 and cache.bytes == 5 * per_block


def test_persistence_across_a_restart_and_refused_files(tiny, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="triforce.serve")
    tok, kv = tiny.tokenizer, tmp_path / "kv"
    ids = tok(DOC + "Z")["input_ids"]
    ref = reference(tiny, ids, 24)
    with serving(tiny, kv_cache_dir=kv) as (url, server):
        assert client(url).completions.create(model="t", prompt=DOC, max_tokens=4, temperature=0)
        folder = server.prefix_cache.dir
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == (len(DOC) - 1) // 16 and (folder / "manifest.json").exists()

    with serving(tiny, kv_cache_dir=kv) as (url, server):  # a restart: the blocks come from disk
        assert server.prefix_cache.stats()["blocks"] == len(files)
        r = client(url).completions.create(model="t", prompt=DOC + "Z", max_tokens=24, temperature=0)
    assert ext(r)["prefix_cache_tokens"] == len(files) * 16 and r.choices[0].text == ref.text

    # another model (or KV dtype...) never reads them: its own folder, the other refused with a log line
    other_tok = char_tokenizer()
    other_model = ours_from_hf(hf_tiny("llama", seed=2, vocab_size=len(other_tok)))
    other = LoadedModel(other_model, other_tok, other_model.cfg, "other", Path("."))
    caplog.clear()
    with serving(other, kv_cache_dir=kv) as (url, server):
        r = client(url).completions.create(model="t", prompt=DOC + "Z", max_tokens=4, temperature=0)
        other_folder = server.prefix_cache.dir
    assert ext(r)["prefix_cache_tokens"] == 0 and other_folder != folder
    assert any("refusing the KV cache in" in m and "model" in m for m in caplog.messages)

    # damaged files of our own: truncated, one flipped byte, and one made by the other model put in our folder
    manifest = json.loads((folder / "manifest.json").read_text())
    by_index = sorted(manifest["blocks"].values(), key=lambda e: e["index"])
    truncated, flipped, foreign = (folder / by_index[i]["file"] for i in (9, 5, 2))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 0xFF
    flipped.write_bytes(bytes(data))
    alien = next(other_folder.glob("*.safetensors")).read_bytes()
    foreign.write_bytes(alien)
    import hashlib

    entry = next(e for e in manifest["blocks"].values() if e["file"] == foreign.name)
    entry["bytes"], entry["sha256"] = len(alien), hashlib.sha256(alien).hexdigest()  # its size and hash look right
    (folder / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    with serving(tiny, kv_cache_dir=kv) as (url, server):
        assert server.prefix_cache.stats()["blocks"] == 2  # only the blocks before the first refused one
        r = client(url).completions.create(model="t", prompt=DOC + "Z", max_tokens=24, temperature=0)
    refusals = [m for m in caplog.messages if m.startswith("refusing the KV cache file")]
    assert any("truncated" in m for m in refusals) and any("corrupt" in m for m in refusals)
    assert any("another model" in m for m in refusals) and len(refusals) == 3
    assert r.choices[0].text == ref.text and ext(r)["prefix_cache_tokens"] == 32


@pytest.fixture
def slow_rounds(monkeypatch):
    """Each speculation round takes at least 20 ms more: time to cancel mid-stream."""
    real = engine_module.generate_stream

    class Slow:
        def __init__(self, stream):
            self.stream = stream

        @property
        def result(self):
            return self.stream.result

        @property
        def levels(self):
            return self.stream.levels

        def __iter__(self):
            for chunk in self.stream:
                time.sleep(0.02)
                yield chunk

    monkeypatch.setattr(engine_module, "generate_stream", lambda *a, **k: Slow(real(*a, **k)))


def test_requests_of_one_size_take_the_finished_ones_cache_buffers_and_answer_as_generate(tiny):
    """Each request's full cache, and its retrieval level's once built, come from the engine's pool where a finished
    request of its size gave its buffers back (zeroed): the answers stay generate()'s, greedy and sampled, in either
    order."""
    tok = tiny.tokenizer
    prompts = [DOC + "Q1", DOC + "Q22", DOC + "Q3"]  # capacities in one size class (engine.full_cache_tokens)
    with serving(tiny) as (url, server):
        c = client(url)
        pool = server.engine.pool

        def answer(prompt, **sampling):
            text = c.completions.create(model="t", prompt=prompt, max_tokens=30, **sampling).choices[0].text
            # the answer goes out before the engine gives the request's buffers back (at its job's end): the next
            # request finds them in the pool only after that, which on a loaded machine can come later
            wait_for(lambda: server.engine.depth() == (0, 0))
            return text

        got = [answer(p, temperature=0) for p in prompts]
        sampled = answer(prompts[0], temperature=0.8, seed=3)
        # K and V of the full and the retrieval cache (STACK is fixed, not adaptive: every request builds its
        # retrieval level): new for the first request, then taken
        assert (pool.hits, pool.misses) == (4 * 3, 4)
    assert got == [reference(tiny, tok(p)["input_ids"], 30).text for p in prompts]
    assert sampled == reference(tiny, tok(prompts[0])["input_ids"], 30, SamplingParams(0.8), seed=3).text


def test_an_int8_cache_server_ends_each_request_and_answers_as_generate(tiny):
    """With an int8 KV cache (a QuantizedCache, which takes no buffers from the pool) each request still ends cleanly
    and frees its place: its release is the interface's no-op."""
    import copy

    model = copy.copy(tiny.model)
    model.kv_dtype = "int8"
    loaded = LoadedModel(model, tiny.tokenizer, model.cfg, "tiny", Path("."))
    prompts = [DOC + "Q1", DOC + "Q2"]
    with serving(loaded) as (url, server):
        got = [client(url).completions.create(model="t", prompt=p, max_tokens=20, temperature=0).choices[0].text
               for p in prompts]
        wait_for(lambda: server.engine.depth() == (0, 0))
        assert server.engine.pool.hits == 0
    assert got == [reference(loaded, tiny.tokenizer(p)["input_ids"], 20).text for p in prompts]


def test_kept_buffers_give_way_to_a_request_within_the_kv_budget(tiny):
    """The pool's buffers count against the KV budget with the running requests': admitting a request that the
    running ones leave room for frees kept buffers until the total fits, instead of refusing it or going over."""
    budget = 10 << 20
    with serving(tiny, kv_memory=budget) as (url, server):
        engine = server.engine
        kept = [torch.zeros(1 << 20) for _ in range(2)]  # 8 MiB kept
        for t in kept:
            engine.pool.give(t)
        assert engine.pool.bytes == 8 << 20
        job = engine_module.Job([1, 2, 3], 4, SamplingParams(), 0, (), lambda event: None)
        job.need = 5 << 20
        with engine._cv:
            assert engine._fits(job)
        assert engine.pool.bytes == 4 << 20  # one 4 MiB buffer freed: 5 + 4 <= 10
        job.need = 11 << 20  # more than the whole budget: not admitted, and the pool is left as it is
        with engine._cv:
            assert not engine._fits(job)
        assert engine.pool.bytes == 4 << 20


def test_queue_full_429_cancel_and_timeout(tiny, slow_rounds):
    gate = threading.Event()
    with serving(tiny, max_queue=1, max_batch=1) as (url, server):
        engine = server.engine
        real_run = engine._run
        engine._run = lambda job: (gate.wait(30), real_run(job))  # hold the engine on the first job
        results = {}

        def call(name, **kw):
            try:
                results[name] = client(url).completions.create(model="t", prompt=DOC, temperature=0, **kw)
            except Exception as e:  # noqa: BLE001
                results[name] = e

        first = threading.Thread(target=call, args=("first",), kwargs={"max_tokens": 8})
        first.start()
        wait_for(lambda: engine.depth() == (0, 1))
        second = threading.Thread(target=call, args=("second",), kwargs={"max_tokens": 8})
        second.start()
        wait_for(lambda: engine.depth() == (1, 1))
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            client(url).completions.create(model="t", prompt="hi", max_tokens=2)
        gate.set()
        first.join(30), second.join(30)
        assert results["first"].usage.completion_tokens >= 1 and results["second"].usage.completion_tokens >= 1

        # a client that leaves mid-stream cancels its generation and frees the engine
        stream = client(url).completions.create(model="t", prompt=DOC, max_tokens=300, temperature=0, stream=True)
        got = [next(iter(stream)) for _ in range(2)]
        stream.close()
        assert got
        wait_for(lambda: server.metrics.finished.labels("cancelled")._value.get() >= 1)
        assert server.metrics.finished.labels("cancelled")._value.get() == 1
        assert engine.depth() == (0, 0)
        after = client(url).completions.create(model="t", prompt="hi there", max_tokens=4, temperature=0)
        assert after.usage.completion_tokens >= 1
        assert server.metrics.generation_tokens._value.get() < 8 + 8 + 300  # the cancelled one stopped early

        engine.s.request_timeout = 0.2  # a request past --request-timeout: 504 (non-streamed), an error event (streamed)
        r = httpx.post(url + "/v1/completions", json={"prompt": DOC, "max_tokens": 300, "temperature": 0})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        # greedy, as the request above (sampled, the tiny model could end on EOS inside the 0.2 s: seen once)
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": DOC, "max_tokens": 300, "temperature": 0, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert '"code": "timeout"' in lines[-2] and lines[-1] == "data: [DONE]"


def test_serve_cli_checks_its_input(capsys):
    from triforce.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
    assert main(["serve", "--levels", "ngram,full,full"]) == 2
    assert "'full' more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--prefix-cache-bytes", "lots"])
    assert "expected a size" in capsys.readouterr().err


@pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
def test_embedded_model_greedy_text_equals_generate_with_a_cached_prefix():
    from triforce.corpus import demo_text
    from triforce.loading import load_model
    from triforce.speculation.stack import method_stack

    loaded = load_model(progress=False)  # the CLI's defaults: fp16 KV cache, triforce, prefill chunk 512
    config = SpecConfig()
    stack = method_stack("triforce", config.gamma, config.gamma_draft, config.draft)
    doc = demo_text()[:2200]  # ~650 tokens: one whole 512-token block to reuse
    conversations = [[{"role": "user", "content": f"{doc}\n\n{q}"}] for q in ("Who speaks first?", "Name a place.")]
    answers = []
    with serving(loaded, stack, config) as (url, _):
        c = client(url)
        for messages in conversations:
            answers.append(c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                     temperature=0))
    assert ext(answers[0])["prefix_cache_tokens"] == 0 and ext(answers[1])["prefix_cache_tokens"] == 512
    tok = loaded.tokenizer
    for messages, answer in zip(conversations, answers):
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]
        ref = generate(loaded.model, ids, 16, stack=stack, config=config, eos_ids=loaded.eos_token_ids, tokenizer=tok)
        # what `triforce generate --chat --prompt-file F --max-new-tokens 16` prints
        assert answer.choices[0].message.content == ref.text and ref.text.strip()
