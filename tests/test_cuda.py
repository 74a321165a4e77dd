"""On a CUDA GPU: the forward against transformers in fp32 / bf16 / fp16, greedy `ar` against
transformers' greedy decoding, every stack token-identical to `ar` (CUDA graphs make the verifier
score a token exactly as `ar` does), sampling exact by the chi-square check (fewer samples than the
CPU suite), the split-KV decode kernel against a float64 reference, and the offloaded KV cache.

Run with `python -m pytest -m cuda` on a machine with a GPU; skipped everywhere else (CI has none).
"""
from __future__ import annotations

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.generate import generate, generate_ar
from triforce.sampling import SamplingParams
from triforce.speculation.settings import SpecConfig
from triforce.speculation.stack import METHODS, StackSpec
from triforce.caches import new_cache

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Head dims of 64 so that the graph forwards use the decode kernel (kernels/cuda_decode.py)
KERNEL_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=2048, initializer_range=0.1)
SPEC = SpecConfig(gamma=4, gamma_draft=2, budget=96, chunk_size=8, recent=16, rebuild_every=24, sink=4, window=32,
                  ngram=3, prefill_chunk=64)


def _prompt(n: int, seed: int, vocab: int = 96) -> list[int]:
    base = torch.randint(0, vocab, (n // 4,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (base * 4)[:n]


def _ours(hf, dtype):
    model = ours_from_hf(hf).to(device="cuda", dtype=dtype)
    model.kv_dtype = None
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_matches_transformers(arch, dtype):
    """Prefill logits and graph-decoded logits vs a float64 reference: no worse than transformers itself
    in the same dtype on the same GPU (plus a little), and close in fp32."""
    ids = _prompt(120, 1)
    with torch.no_grad():
        ref = hf_tiny(arch, seed=3, **KERNEL_SHAPE).double()(torch.tensor([ids])).logits[0]
        hf_gpu = hf_tiny(arch, seed=3, **KERNEL_SHAPE).to(device="cuda", dtype=DTYPES[dtype])
        theirs = hf_gpu(torch.tensor([ids], device="cuda")).logits[0]
    ours = _ours(hf_tiny(arch, seed=3, **KERNEL_SHAPE), DTYPES[dtype])
    assert ours.graphs is not None
    cache = new_cache(ours, 256)
    head = ours(torch.tensor([ids[:100]], device="cuda"), cache)[0]  # eager prefill
    decoded = [ours.graphs.forward(ids[100:101], cache, last=1)]  # one token through the graph
    decoded.append(ours.graphs.forward(ids[101:106], cache, last=5))  # five at once
    for i in range(106, 120):
        decoded.append(ours.graphs.forward(ids[i:i + 1], cache, last=1))
    got = torch.cat([head] + decoded)
    err_ours, err_theirs = _rel(got, ref), _rel(theirs, ref)
    limit = 1e-5 if dtype == "fp32" else 2 * err_theirs + 2e-3
    assert err_ours <= max(limit, 2 * err_theirs), (dtype, err_ours, err_theirs)


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, recomputed from scratch each step (no stopping at EOS)."""
    ids = torch.tensor([prompt], device=next(hf.parameters()).device)
    for _ in range(n):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_greedy_ar_matches_transformers_fp32():
    hf = hf_tiny("llama", seed=5, **KERNEL_SHAPE).cuda()
    prompt = _prompt(200, 2)
    theirs = _hf_greedy(hf, prompt, 40)
    ours = generate_ar(_ours(hf.cpu(), torch.float32), prompt, 40).tokens
    assert ours == theirs


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_greedy_ar_follows_transformers_to_rounding(dtype):
    """In half precision two implementations may part where the top two logits are within rounding:
    every token where ours and transformers' greedy choices first differ must be such a near tie of the
    float64 reference."""
    hf = hf_tiny("llama", seed=6, **KERNEL_SHAPE)
    prompt = _prompt(150, 3)
    ours = generate_ar(_ours(hf, DTYPES[dtype]), prompt, 40).tokens
    hf_half = hf_tiny("llama", seed=6, **KERNEL_SHAPE).to(device="cuda", dtype=DTYPES[dtype])
    theirs = _hf_greedy(hf_half, prompt, 40)
    if ours == theirs:
        return
    i = next(j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    with torch.no_grad():
        logits = hf.double()(torch.tensor([prompt + ours[:i]])).logits[0, -1]
    gap = abs(float(logits[ours[i]] - logits[theirs[i]]))
    assert gap < 0.02 * float(logits.std()), (i, gap, float(logits.std()))


STACKS = ["triforce", "retrieval", "ngram", "streaming"]
USER_STACKS = ["ngram,retrieval:64,full@2,4", "streaming:24,retrieval:96,full@2,3", "retrieval:64,full@6"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_stack_is_token_identical_to_ar(dtype):
    """Greedy: every named method and user stacks give ar's tokens, bit for bit (the graph forwards'
    rows do not depend on each other, so a verified token is scored exactly as ar scores it)."""
    model = _ours(hf_tiny("llama", seed=7, **KERNEL_SHAPE), DTYPES[dtype])
    for seed, n in ((0, 400), (1, 257)):
        prompt = _prompt(n, seed)
        ref = generate_ar(model, prompt, 80, config=SPEC).tokens
        for method in STACKS:
            assert generate(model, prompt, 80, method=method, config=SPEC).tokens == ref, (method, seed)
        for spec in USER_STACKS:
            levels, gammas = spec.split("@")
            res = generate(model, prompt, 80, stack=StackSpec.parse(levels, gammas), config=SPEC)
            assert res.tokens == ref, (spec, seed)
    assert model.graphs.replays > 0


# The kinds the stacks above leave out, as tests/test_speculation_greedy.py runs them on the CPU: kv4 (the
# target reading its cache at 4 bits), h2o, a draft model, and Sequoia trees drafted by the bottom level
# (levels, gammas, tree widths).
KIND_STACKS = [("ngram,kv4,full", "3", None), ("kv4,streaming:24,full", "2,3", None), ("ngram,h2o:40,full", "2,4", None),
               ("draft,retrieval:96,full", "2,3", None), ("streaming:24,full", "3", "3,2,1"),
               ("h2o:40,full", "3", "2,2,1"), ("draft,full", "4", "4,1,1,1")]


@pytest.fixture(scope="module")
def kind_models():
    target = _ours(hf_tiny("llama", seed=7, **KERNEL_SHAPE), torch.float32)
    draft = _ours(hf_tiny("llama", seed=8, **{**KERNEL_SHAPE, "hidden_size": 64, "intermediate_size": 128,
                                             "num_attention_heads": 1, "num_key_value_heads": 1}), torch.float32)
    return target, draft


def _head_for(hf, path):
    """A draft head for `hf`'s model (tests/test_drafthead.py's make_head: the identity, perturbed), saved to path."""
    from test_drafthead import make_head

    return str(make_head(ours_from_hf(hf), path))


@pytest.fixture(scope="module")
def kind_head(tmp_path_factory):
    return _head_for(hf_tiny("llama", seed=7, **KERNEL_SHAPE), tmp_path_factory.mktemp("head"))


@pytest.mark.parametrize("levels,gammas,tree", KIND_STACKS)
def test_every_kind_is_token_identical_to_ar(kind_models, levels, gammas, tree):
    """Greedy, fp32: stacks with kv4, h2o, draft-model and tree levels give ar's tokens, every level run."""
    model, draft = kind_models
    for seed, n in ((0, 400), (1, 257)):
        prompt = _prompt(n, seed)
        ref = generate_ar(model, prompt, 64, config=SPEC).tokens
        stack = StackSpec.parse(levels, gammas, tree=tree)
        res = generate(model, prompt, 64, stack=stack, config=SPEC, draft_model=draft)
        assert res.tokens == ref, (levels, tree, seed)
        assert all(lvl["rounds"] >= 1 for lvl in res.stats["levels"][:-1]), res.stats["levels"]


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"])
def test_every_named_method_is_token_identical_to_ar(kind_models, method):
    """Greedy, fp32: each method of docs/usage.md's table (`draft` with a small model) gives ar's tokens."""
    model, draft = kind_models
    for seed, n in ((0, 400), (1, 257)):
        prompt = _prompt(n, seed)
        ref = generate_ar(model, prompt, 64, config=SPEC).tokens
        assert generate(model, prompt, 64, method=method, config=SPEC, draft_model=draft).tokens == ref, (method, seed)


# the draft head (`head`) at the bottom: a chain, under a retrieval level, and drafting trees
HEAD_STACKS = [("head,full", "3", None), ("head,retrieval:96,full", "2,3", None), ("head,full", "3", "3,2")]


@pytest.mark.parametrize("levels,gammas,tree", HEAD_STACKS)
def test_head_stacks_are_token_identical_to_ar(kind_models, kind_head, levels, gammas, tree):
    """Greedy, fp32: stacks with a draft head at the bottom (the head on the GPU, reading the target's features)
    give ar's tokens, the levels above verifying the head's drafts."""
    model, _ = kind_models
    config = SpecConfig(**{**SPEC.__dict__, "head": kind_head})
    for seed, n in ((0, 400), (1, 257)):
        prompt = _prompt(n, seed)
        ref = generate_ar(model, prompt, 64, config=SPEC).tokens
        res = generate(model, prompt, 64, stack=StackSpec.parse(levels, gammas, tree=tree), config=config)
        assert res.tokens == ref, (levels, tree, seed)
        assert res.stats["levels"][0]["rounds"] >= 1, res.stats["levels"]


@pytest.mark.parametrize("levels,gammas", [("ngram,retrieval:96,full", "2,4"), ("ngram,kv4,retrieval:96,full", "2,2,3"),
                                           ("streaming:24,full", "3")])
def test_int8_kv_stacks_are_token_identical_to_ar(levels, gammas):
    """Greedy: a target keeping its KV cache in int8 (caches/quantized.py, eager on the GPU) gives the tokens of
    its own `ar` through every level kind that reads that cache."""
    model = _ours(hf_tiny("llama", seed=7, **KERNEL_SHAPE), torch.float32)
    model.kv_dtype = "int8"
    for seed, n in ((0, 400), (1, 257)):
        prompt = _prompt(n, seed)
        ref = generate_ar(model, prompt, 64, config=SPEC).tokens
        res = generate(model, prompt, 64, stack=StackSpec.parse(levels, gammas), config=SPEC)
        assert res.tokens == ref, (levels, seed)


def test_graph_rows_are_bitwise_independent():
    """The same token at the same position gets the same logits alone or among four others (bf16)."""
    model = _ours(hf_tiny("llama", seed=8, **KERNEL_SHAPE), torch.bfloat16)
    ids = _prompt(300, 4)
    a, b = new_cache(model, 400), new_cache(model, 400)
    for cache in (a, b):
        model(torch.tensor([ids[:290]], device="cuda"), cache)
    together = model.graphs.forward(ids[290:295], a, last=5)
    alone = torch.cat([model.graphs.forward(ids[i:i + 1], b, last=1) for i in range(290, 295)])
    assert torch.equal(together, alone)


def test_decode_kernel_matches_float64():
    from triforce.kernels import cuda_decode

    if not cuda_decode.available():
        pytest.skip("no Triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    for Hkv, rows, D, C, dtype, window, sink in ((8, 4, 128, 5000, torch.bfloat16, 0, 0),
                                                 (32, 16, 128, 3000, torch.float16, 0, 0),
                                                 (2, 48, 64, 700, torch.float32, 0, 0),
                                                 (8, 16, 128, 5000, torch.bfloat16, 1000, 4)):  # a StreamingLLM window
        q = torch.randn(Hkv, rows, D, device="cuda", generator=g).to(dtype)
        k = torch.randn(Hkv, C, D, device="cuda", generator=g).to(dtype)
        v = torch.randn(Hkv, C, D, device="cuda", generator=g).to(dtype)
        last = torch.randint(0, C - 100, (rows,), device="cuda", generator=g).int()
        out = cuda_decode.decode_attention(q, k, v, last, D ** -0.5, cuda_decode.block_rows(rows),
                                           cuda_decode.split_size(C, Hkv), window=window, sink=sink)
        s = (q.double() @ k.double().transpose(1, 2)) * D ** -0.5
        cols, ends = torch.arange(C, device="cuda")[None, None], last[None, :, None].long()
        hidden = (cols > ends) | ((cols >= sink) & (cols <= ends - window)) if window else cols > ends
        s = s.masked_fill(hidden, float("-inf"))
        ref = torch.softmax(s, -1) @ v.double()
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        assert _rel(out, ref) < tol, (dtype, _rel(out, ref))


@torch.no_grad()
def test_streaming_level_replays_graphs_with_its_window():
    """A StreamingLLM cache's chains replay CUDA graphs (the window derived from each row's slot) and give the
    eager forward's logits through a twin cache, across compactions and rollbacks (fp32)."""
    from triforce.caches import StreamingCache

    model = _ours(hf_tiny("llama", seed=7, **KERNEL_SHAPE), torch.float32)
    c = model.cfg

    def streaming():
        return StreamingCache(c.n_layers, c.n_kv_heads, c.head_dim, sink=4, window=48, max_rollback=8, slack=40,
                              device="cuda")

    ids = _prompt(400, 5)
    eager, graphed = streaming(), streaming()
    for cache in (eager, graphed):
        for i in range(0, 100, 20):
            model(torch.tensor([ids[i:i + 20]], device="cuda"), cache)
    replays, pos = model.graphs.replays, 100
    for step, n in enumerate([1, 5, 3, 1, 6] * 30):
        if pos + n > 400:
            break
        if step % 4 == 0:  # a rejected draft
            for cache in (eager, graphed):
                model(torch.tensor([ids[:n]], device="cuda"), cache)
                cache.rollback(pos)
        a = model(torch.tensor([ids[pos:pos + n]], device="cuda"), eager)[0]
        if model.graphs.usable(graphed, None, n):
            b = model.graphs.forward(ids[pos:pos + n], graphed, last=n)
        else:
            b = model(torch.tensor([ids[pos:pos + n]], device="cuda"), graphed)[0]
        assert _rel(b, a) < 1e-5, (step, _rel(b, a))
        pos += n
    assert model.graphs.replays - replays >= 40 and graphed.start > graphed.sink


def test_offloaded_cache_is_exact():
    """--offload-kv: the same logits as the GPU-resident cache (fp32, eager both), and a triforce run
    through it gives ar's tokens."""
    from triforce.caches.offload import OffloadedCache

    model = _ours(hf_tiny("llama", seed=9, **KERNEL_SHAPE), torch.float32)
    ids = _prompt(300, 5)
    model.graphs, graphs = None, model.graphs
    resident = new_cache(model, 400)
    model.offload_kv = True
    off = new_cache(model, 400)
    assert isinstance(off, OffloadedCache)
    la = model(torch.tensor([ids[:200]], device="cuda"), resident)
    lb = model(torch.tensor([ids[:200]], device="cuda"), off)
    for i in range(200, 210):
        la = torch.cat([la, model(torch.tensor([ids[i:i + 1]], device="cuda"), resident)], 1)
        lb = torch.cat([lb, model(torch.tensor([ids[i:i + 1]], device="cuda"), off)], 1)
    assert _rel(lb, la) < 1e-6
    ref = generate_ar(model, ids, 40, config=SPEC).tokens
    assert generate(model, ids, 40, method="triforce", config=SPEC).tokens == ref
    model.offload_kv, model.graphs = False, graphs


# Sampling: the chi-square check of tests/test_speculation_distribution.py on the GPU, fewer samples.
N_CUDA_SAMPLES = 400


def _dist_prompt() -> list[int]:
    from test_speculation_distribution import V

    base = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return (base * 4)[:48]  # as test_speculation_distribution's prompt


@pytest.fixture(scope="module")
def dist_models():
    from test_speculation_distribution import V

    target = ours_from_hf(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5,
                                  max_position_embeddings=256)).to("cuda")
    draft = ours_from_hf(hf_tiny("llama", seed=22, vocab_size=V, initializer_range=0.5, hidden_size=32,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)).to("cuda")
    return target, draft


@pytest.fixture(scope="module")
def dist_head(tmp_path_factory):
    from test_speculation_distribution import V

    return _head_for(hf_tiny("llama", seed=21, vocab_size=V, initializer_range=0.5, max_position_embeddings=256),
                     tmp_path_factory.mktemp("dist_head"))


@pytest.mark.parametrize("method,levels,gammas,tree,params", [
    ("triforce", None, None, None, SamplingParams(temperature=1.0)),
    (None, "ngram,streaming:8,retrieval:12,full", "2,2,3", None, SamplingParams(temperature=0.8, top_k=5)),
    (None, "draft,retrieval:12,full", "2,3", None, SamplingParams(temperature=1.0, top_p=0.8)),
    (None, "streaming:8,full", "2", "3,2", SamplingParams(temperature=1.0)),  # Sequoia trees
    (None, "kv4,full", "3", None, SamplingParams(temperature=0.8)),
    (None, "head,full", "2", "3,2", SamplingParams(temperature=1.0)),  # a draft head's trees
])
def test_sampling_is_exact_on_cuda(dist_models, dist_head, method, levels, gammas, tree, params):
    from test_speculation_distribution import ALPHA, CFG, exact_marginals, p_values, sample_counts

    prompt = _dist_prompt()
    exact = exact_marginals(dist_models[0], prompt, params)
    stack = StackSpec.parse(levels, gammas, tree=tree) if levels else None
    cfg = SpecConfig(**{**CFG.__dict__, "head": dist_head})
    counts = sample_counts(dist_models, prompt, method, cfg, n=N_CUDA_SAMPLES, params=params, stack=stack)
    pv = p_values(counts, exact)
    assert min(pv) > ALPHA, (method or levels, pv)


def test_wrong_sampler_is_caught_on_cuda(dist_models, monkeypatch):
    import triforce.speculation.level as level_mod
    from test_speculation_distribution import CFG, PARAMS, exact_marginals, p_values, sample_counts
    from test_speculation_distribution import wrong_verify

    prompt = _dist_prompt()
    exact = exact_marginals(dist_models[0], prompt, PARAMS)
    monkeypatch.setattr(level_mod, "verify_tree", wrong_verify)
    cfg = SpecConfig(**{**CFG.__dict__, "draft": "draft"})
    pv = p_values(sample_counts(dist_models, prompt, "triforce", cfg, n=N_CUDA_SAMPLES), exact)
    assert min(pv) < 1e-4, pv


def test_cli_generate_on_cuda(tmp_path):
    """`triforce generate --device cuda` end to end (a tiny model directory with a character tokenizer):
    every method gives ar's text, bf16 by default on CUDA, with and without --offload-kv."""
    import json
    import subprocess
    import sys

    from test_perplexity import char_tokenizer

    d = tmp_path / "tiny"
    hf_tiny("llama", seed=10, **dict(KERNEL_SHAPE, max_position_embeddings=4096)).save_pretrained(str(d))
    char_tokenizer(bos=True).save_pretrained(str(d))
    prompt = "It was the best of times, it was the worst of times. " * 30

    def gen(*extra):
        r = subprocess.run([sys.executable, "-m", "triforce", "generate", "--model", str(d), "--device", "cuda",
                            "--prompt", prompt, "--max-new-tokens", "40", "--json", "--quiet", "--budget", "256",
                            "--recent", "16", *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    ar = gen("--method", "ar")
    assert ar["token_ids"]
    for extra in (["--method", "triforce"], ["--levels", "ngram,retrieval:256,full", "--gammas", "2,4"],
                  ["--method", "triforce", "--offload-kv"], ["--method", "ar", "--offload-kv", "--dtype", "float32"]):
        out = gen(*extra)
        if "float32" in extra:
            assert out["token_ids"]  # another dtype: another model, its own text
        else:
            assert out["token_ids"] == ar["token_ids"], extra


def test_bench_floors_use_the_gpu_bandwidth():
    """`triforce bench --device cuda` prices its floors with the GPU's memory, not the host's (the first H200
    run of the embedded model printed a 32K floor of 11.9 ms from host bandwidth beside 3.6 ms forwards)."""
    from triforce.bench.hardware import measure_bandwidth

    assert measure_bandwidth(device="cuda") > 5 * measure_bandwidth()
