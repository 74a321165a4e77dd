"""GPU measurements for docs/gpu.md: `python benchmarks/gpu_costs.py [--shapes llama2-7b,llama3-8b] [--json F]`.

On one CUDA GPU, with random-weight bf16 models of 7B/8B shape (the time of a forward does not depend
on the weights' values) and K/V filled with random values up to the context length (no prefill):
- the two ceilings: a device-to-device copy (HBM, bytes read + written) and pinned host -> device (PCIe);
- per context: the `ar` step eager and as a CUDA graph, against the HBM floor (weights + the K/V read
  once, over the measured copy bandwidth); a verification forward of gamma + 1 tokens; a retrieval
  level's forward (budget 4096) of 1 and gamma_draft + 1 tokens and its rebuild; with the cache
  offloaded (--offload-kv), a verification forward against the PCIe floor (K/V bytes / measured PCIe);
- re-priced speedups: the i.i.d. acceptance model of `triforce tune` (speculation/cost_model.predict_ms) with these
  costs and per-token acceptances you pass (measured on the embedded model: --acceptance).
Medians of repeated timings with CUDA events after warm-up.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from triforce.caches import new_cache
from triforce.caches.synthetic import fill_random
from triforce.storage import atomic_write

SHAPES = {
    "llama2-7b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                  "rms_norm_eps": 1e-5, "max_position_embeddings": 131072 + 1024, "rope_theta": 10000.0},
    "llama3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                  "rms_norm_eps": 1e-5, "max_position_embeddings": 131072 + 1024, "rope_theta": 500000.0},
}


def _events_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def hbm_bandwidth(gib: float = 4.0) -> float:
    """GB/s of a device-to-device copy, bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _events_ms(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * n * 2 / ms / 1e6


def pcie_bandwidth(gib: float = 2.0) -> float:
    """GB/s of a pinned host -> device copy."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ms = _events_ms(lambda: dst.copy_(src, non_blocking=True), 5)
    del src, dst
    return n / ms / 1e6


def random_model(shape: dict, dtype=torch.bfloat16):
    from triforce.config import ModelConfig
    from triforce.model import Transformer

    cfg = ModelConfig.from_hf(shape)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"), torch.no_grad():
            model = Transformer(cfg)
            for p in model.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    finally:
        torch.set_default_dtype(prev)
    model.init_rotary()
    return model.to("cuda").eval()


def _graph_ms(fn, reps: int = 20) -> float:
    """Median ms of fn captured in a CUDA graph (no launch gaps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _events_ms(g.replay, reps)


@torch.inference_mode()
def breakdown(model, cache, hbm: float, log, sweep: bool = False) -> dict:
    """Each part of a graph forward over all layers, alone, in a CUDA graph: the linear layers at 1, 8 and
    16 rows (cuBLAS), the decode kernel over the cache, against their bytes over the copy bandwidth;
    with `sweep`, the decode kernel's launch settings (kernels/cuda_decode.py PER_SM, WARPS, STAGES)."""
    import torch.nn.functional as F

    from triforce.kernels import cuda_decode

    out = {}
    layers = model.layers
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        ws = [getattr(layer, name).weight for layer in layers]
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for rows in (1, 8, 16):
            x = torch.randn(rows, ws[0].shape[1], device="cuda", dtype=model.dtype)
            out[f"{name}_{rows}_ms"] = _graph_ms(lambda: [F.linear(x, w) for w in ws])
        out[f"{name}_floor_ms"] = nbytes / hbm / 1e6
    w = model.lm_head.weight
    for rows in (1, 16):
        x = torch.randn(rows, w.shape[1], device="cuda", dtype=model.dtype)
        out[f"lm_head_{rows}_ms"] = _graph_ms(lambda: F.linear(x, w))
    out["lm_head_floor_ms"] = w.numel() * w.element_size() / hbm / 1e6
    if cuda_decode.available():
        cfg = model.cfg
        g = cfg.n_heads // cfg.n_kv_heads
        n = cache.length
        C = cache.k.shape[3]
        for rows_t in (1, 16):
            q = torch.randn(cfg.n_kv_heads, g * rows_t, cfg.head_dim, device="cuda", dtype=model.dtype)
            last = torch.full((g * rows_t,), n - 1, dtype=torch.int32, device="cuda")
            bm, split = cuda_decode.block_rows(g * rows_t), cuda_decode.split_size(C, cfg.n_kv_heads)
            out[f"attention_{rows_t}_ms"] = _graph_ms(lambda: [cuda_decode.decode_attention(
                q, cache.k[i, 0], cache.v[i, 0], last, 0.1, bm, split) for i in range(cfg.n_layers)])
        out["attention_floor_ms"] = 2 * cfg.n_layers * cfg.n_kv_heads * n * cfg.head_dim * 2 / hbm / 1e6
        q = torch.randn(cfg.n_kv_heads, g * 16, cfg.head_dim, device="cuda", dtype=model.dtype)
        last = torch.full((g * 16,), n - 1, dtype=torch.int32, device="cuda")
        for per_sm in ((1, 2, 4) if sweep else ()):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    split = cuda_decode.split_size(C, cfg.n_kv_heads, per_sm=per_sm)
                    try:
                        out[f"attention_16_sm{per_sm}_w{warps}_s{stages}_ms"] = _graph_ms(lambda: [
                            cuda_decode.decode_attention(q, cache.k[i, 0], cache.v[i, 0], last, 0.1,
                                                         cuda_decode.block_rows(g * 16), split, warps, stages)
                            for i in range(cfg.n_layers)], reps=10)
                    except Exception as e:  # a setting that does not compile (resources)
                        log(f"attention sm{per_sm} w{warps} s{stages}: {type(e).__name__}")
    log(json.dumps({k: round(v, 3) for k, v in out.items()}))
    return out


# launch settings tried by --kernel-sweep: programs per multiprocessor, whole waves, (warps, pipeline stages)
SWEEP_PER_SM = (1, 2, 4)
SWEEP_LAUNCH = ((4, 3), (8, 3), (4, 2), (4, 4), (8, 2))


@torch.inference_mode()
def decode_kernel_sweep(contexts: list[int], hbm: float, log, layers: int = 4, tokens: int = 16) -> list[dict]:
    """The decode kernel alone (kernels/cuda_decode.py) for the KV-head counts of the 7B/8B shapes (Llama-3-8B: 8 KV
    heads of 4 query heads; Llama-2-7B: 32 of 1; head dim 128, bf16), `tokens` query rows per KV-head group as every
    graph forward has, over `layers` distinct caches of context + 256 slots (each far beyond L2) filled up to the
    context: every launch setting against the floor (K/V bytes read / copy bandwidth), beside PyTorch's SDPA over the
    same keys for one token (what the eager step runs). One row per (shape, context)."""
    import torch.nn.functional as F

    from triforce.kernels import cuda_decode

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name in ("llama3-8b", "llama2-7b"):
        shape = SHAPES[name]
        Hkv = shape["num_key_value_heads"]
        g = shape["num_attention_heads"] // Hkv
        D = shape["hidden_size"] // shape["num_attention_heads"]
        for ctx in contexts:
            C = ctx + 256
            ks = [torch.randn(Hkv, C, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            vs = [torch.randn(Hkv, C, D, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            q = torch.randn(Hkv, g * tokens, D, device="cuda", dtype=torch.bfloat16)
            last = torch.full((g * tokens,), ctx - 1, dtype=torch.int32, device="cuda")
            bm = cuda_decode.block_rows(g * tokens)
            row = {"shape": name, "kv_heads": Hkv, "group": g, "context": ctx, "layers": layers, "tokens": tokens,
                   "floor_ms": 2 * layers * Hkv * ctx * D * 2 / hbm / 1e6, "settings": {}}

            def run(split, warps, stages):
                return _graph_ms(lambda: [cuda_decode.decode_attention(q, ks[i], vs[i], last, D ** -0.5, bm, split,
                                                                       warps, stages) for i in range(layers)], reps=10)

            row["default_ms"] = run(cuda_decode.split_size(C, Hkv, n_sm), None, None)
            for per_sm in SWEEP_PER_SM:
                for whole in (False, True):
                    split = cuda_decode.split_size(C, Hkv, n_sm, per_sm=per_sm, whole_waves=whole)
                    for warps, stages in SWEEP_LAUNCH:
                        key = f"sm{per_sm}{'_whole' if whole else ''}_w{warps}_s{stages}"
                        try:
                            row["settings"][key] = run(split, warps, stages)
                        except Exception as e:  # a setting that does not compile (resources)
                            log(f"{name} {ctx} {key}: {type(e).__name__}")
            qs = torch.randn(1, Hkv * g, 1, D, device="cuda", dtype=torch.bfloat16)
            try:
                row["sdpa_1_token_ms"] = _graph_ms(lambda: [F.scaled_dot_product_attention(
                    qs, ks[i][None, :, :ctx], vs[i][None, :, :ctx], enable_gqa=g > 1) for i in range(layers)], reps=10)
            except Exception as e:
                log(f"{name} {ctx} sdpa: {type(e).__name__}: {e}")
            best = min(row["settings"], key=row["settings"].get)
            row["best"], row["best_ms"] = best, row["settings"][best]
            log(f"decode kernel {name} {ctx}: default {row['default_ms']:.3f} ms, best {best} {row['best_ms']:.3f} ms, "
                f"sdpa(1 token) {row.get('sdpa_1_token_ms', math.nan):.3f} ms, floor {row['floor_ms']:.3f} ms: "
                f"default {row['default_ms'] / row['floor_ms']:.2f}x, best {row['best_ms'] / row['floor_ms']:.2f}x")
            rows.append(row)
            ks.clear()
            vs.clear()
            torch.cuda.empty_cache()
    return rows


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    if not model.cfg.tie_word_embeddings:  # the embedding table is not read by a decode step (one row)
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def measure_shape(name: str, contexts: list[int], gamma: int, gamma_draft: int, budget: int, offload: bool,
                  hbm: float, pcie: float, log, breakdown_too: bool = False, generate_tokens: int = 0) -> list[dict]:
    model = random_model(SHAPES[name])
    cfg = model.cfg
    wbytes = weight_bytes(model)
    rows = []
    for ctx in contexts:
        kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * ctx * 2
        free = torch.cuda.mem_get_info()[0]
        row = {"shape": name, "context": ctx, "weights_GB": wbytes / 1e9, "kv_GB": kv_bytes / 1e9}
        if kv_bytes * 1.05 + 2**30 > free:
            log(f"{name} {ctx}: KV {kv_bytes / 2**30:.1f} GiB does not fit beside the weights ({free / 2**30:.1f} "
                f"GiB free): on-chip rows skipped")
        else:
            measure_on_chip(model, row, ctx, kv_bytes, wbytes, gamma, gamma_draft, budget, hbm, log, breakdown_too)
            if generate_tokens and ctx == contexts[0]:
                measure_generation(model, row, ctx, generate_tokens, gamma, gamma_draft, budget)
        if offload:
            measure_offloaded(model, row, ctx, kv_bytes, gamma, pcie, log)
        torch.cuda.empty_cache()  # the caches (and their graphs) of this context are gone
        if len(row) > 4:
            log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                            if k != "breakdown"}))
            rows.append(row)
    del model
    torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def measure_on_chip(model, row: dict, ctx: int, kv_bytes: int, wbytes: int, gamma: int, gamma_draft: int,
                    budget: int, hbm: float, log, breakdown_too: bool) -> None:
    from triforce.speculation.kinds import KIND_CLASSES
    from triforce.speculation.settings import SpecConfig

    cfg = model.cfg
    cache = new_cache(model, ctx + 256, record_queries=True)
    fill_random(cache, ctx - 1)
    graphs = model.graphs
    tok = [1]

    def eager_step():
        model(torch.tensor([tok], device="cuda"), cache)
        cache.rollback(ctx - 1)

    def graph_step(n=1):
        graphs.forward(tok * n, cache, last=n)
        cache.rollback(ctx - 1)

    if breakdown_too:
        row["breakdown"] = breakdown(model, cache, hbm, log, sweep=breakdown_too == "sweep")
    row["ar_eager_ms"] = _events_ms(eager_step, 10)
    row["ar_graph_ms"] = _events_ms(graph_step, 20)
    row["verify_ms"] = _events_ms(lambda: graph_step(gamma + 1), 20)
    t0 = time.perf_counter()
    for _ in range(20):
        graph_step()
    row["ar_graph_wall_ms"] = (time.perf_counter() - t0) / 20 * 1e3  # host view: what a user waits
    row["hbm_floor_ms"] = (wbytes + kv_bytes) / hbm / 1e6
    row["ar_over_floor"] = row["ar_graph_ms"] / row["hbm_floor_ms"]
    # the retrieval level: built from the full cache's recorded queries (the last graph step's)
    graphs.forward(tok, cache, last=1)
    retr = KIND_CLASSES["retrieval"].new_cache(cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, budget=budget,
                                        recent=64, max_new=256, dtype=model.dtype, device="cuda", model=model,
                                        config=SpecConfig(chunk_size=8))
    retr.build(cache)  # once to warm up (kernels' first launches), then timed
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    retr.build(cache)
    torch.cuda.synchronize()
    row["retrieval_build_ms"] = (time.perf_counter() - t0) * 1e3
    at = retr.length

    def retr_step(n):
        graphs.forward(tok * n, retr, last=n)
        retr.rollback(at)

    row["retrieval_1_ms"] = _events_ms(lambda: retr_step(1), 20)
    row[f"retrieval_{gamma_draft + 1}_ms"] = _events_ms(lambda: retr_step(gamma_draft + 1), 20)
    retr_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * budget * 2
    row["retrieval_floor_ms"] = (wbytes + retr_bytes) / hbm / 1e6
    for level, measure in (("streaming", measure_streaming_level), ("head", measure_head_level)):
        try:  # a drafting level's failure is logged, not fatal: the rows above stand
            measure(model, row, budget, wbytes, hbm)
        except Exception as e:
            log(f"{level} level at {ctx}: {type(e).__name__}: {e}")


def measure_streaming_level(model, row: dict, budget: int, wbytes: int, hbm: float) -> None:
    """The bottom level of the paper's stack on our side: the target with a StreamingLLM cache of `budget` tokens
    (4 sinks), forwards of 1 and 4 tokens as CUDA graphs (its window in slots) and eagerly."""
    from triforce.caches.streaming import StreamingCache

    cfg = model.cfg
    cache = StreamingCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, sink=4, window=budget - 4, max_rollback=16,
                           slack=512, dtype=model.dtype, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (1, budget), device="cuda")
    for i in range(0, budget, 512):
        model(ids[:, i:i + 512], cache)
    at = cache.length

    def step(n):
        model(ids[:, :n], cache)
        cache.rollback(at)

    def graph_step(n):
        model.graphs.forward(ids[0, :n].tolist(), cache, last=n)
        cache.rollback(at)

    row["streaming_eager_1_ms"] = _events_ms(lambda: step(1), 20)
    row["streaming_eager_4_ms"] = _events_ms(lambda: step(4), 20)
    if model.graphs is not None and model.graphs.usable(cache, None, 4):
        row["streaming_1_ms"] = _events_ms(lambda: graph_step(1), 20)
        row["streaming_4_ms"] = _events_ms(lambda: graph_step(4), 20)
    row["streaming_floor_ms"] = (wbytes + 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * budget * 2) / hbm / 1e6


def measure_head_level(model, row: dict, budget: int, wbytes: int, hbm: float, window: int = 1024) -> None:
    """A draft head (drafthead/, EAGLE's design: one decoder layer over [embedding, feature], then the target's LM
    head) of this shape, random weights, on the GPU as a head runs there (fp32, eager): one drafted token = one
    head forward of 1 position with a full `window` cache + the LM head over its prediction."""
    from triforce.caches import new_window_cache
    from triforce.drafthead.drafter import prepare_for_drafting
    from triforce.drafthead.head import DraftHead, HeadConfig, embed_tokens

    cfg = model.cfg
    with torch.device("cuda"):
        head = DraftHead(HeadConfig.for_target(model, window=window), cfg).eval()
    prepare_for_drafting(head, model)
    hc = head.cfg
    cache = new_window_cache(1, hc.n_kv_heads, hc.head_dim, window, 24, dtype=torch.float32, device="cuda")
    feats = torch.randn(1, window - 32, cfg.hidden_size, device="cuda")
    emb = embed_tokens(model, torch.randint(0, cfg.vocab_size, (1, window - 32), device="cuda"))
    cache.prepare(window - 32, None)
    head(feats, emb, torch.arange(window - 32, device="cuda"), cache)
    cache.commit(window - 32)
    at = cache.length

    def draft_one():
        cache.prepare(1, None)
        pred = head(feats[:, :1], emb[:, :1], torch.tensor([at], device="cuda"), cache)
        cache.commit(1)
        head.logits(pred[0, -1], model).argmax()
        cache.rollback(at)

    row["head_1_ms"] = _events_ms(draft_one, 20)
    head_bytes = sum(p.numel() * p.element_size() for p in head.parameters())
    lm = model.lm_head.weight
    row["head_floor_ms"] = (head_bytes + lm.numel() * lm.element_size()
                            + 2 * hc.n_kv_heads * hc.head_dim * window * 4) / hbm / 1e6


@torch.inference_mode()
def measure_generation(model, row: dict, ctx: int, n_new: int, gamma: int, gamma_draft: int, budget: int) -> None:
    """A real prefill of a `ctx`-token prompt (random ids repeated, so the n-gram drafter finds matches),
    then `ar` and triforce for n_new tokens from it: ms/token with every host cost, and whether triforce's
    tokens are ar's (bf16, near-uniform logits of random weights: any row dependence would show)."""
    from triforce.generate import generate
    from triforce.speculation.settings import SpecConfig
    from triforce.speculation.state import PrefilledPrompt

    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, model.cfg.vocab_size, (ctx // 8,), generator=g).tolist()
    prompt = (base * 8)[:ctx]
    cfg = SpecConfig(gamma=gamma, gamma_draft=gamma_draft, budget=budget, prefill_chunk=512,
                     draft_kv_dtype="bf16" if model.dtype == torch.bfloat16 else "fp16")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pre = PrefilledPrompt(model, prompt, ctx + n_new + 64, chunk_size=512)
    torch.cuda.synchronize()
    row["prefill_s"] = time.perf_counter() - t0
    ar = generate(model, prompt, n_new, method="ar", config=cfg, prefilled=pre)
    tri = generate(model, prompt, n_new, method="triforce", config=cfg, prefilled=pre)
    row["generate_ar_ms"] = ar.decode_seconds / len(ar.tokens) * 1e3
    row["generate_triforce_ms"] = tri.decode_seconds / len(tri.tokens) * 1e3
    row["generate_tokens"] = len(ar.tokens)
    row["generate_identical"] = tri.tokens == ar.tokens
    row["generate_triforce_acceptance"] = [lvl.get("acceptance_rate") for lvl in tri.stats["levels"]]


def measure_offloaded(model, row: dict, ctx: int, kv_bytes: int, gamma: int, pcie: float, log) -> None:
    model.offload_kv = True
    try:
        off = new_cache(model, ctx + 256)
    except RuntimeError as e:  # pinned memory refused
        log(f"{model.cfg.n_layers}-layer {ctx}: offloaded cache not allocated ({e})")
        return
    finally:
        model.offload_kv = False
    fill_random(off, ctx - 1)
    tok = [1]

    def off_step(n):
        model(torch.tensor([tok * n], device="cuda"), off)
        off.rollback(ctx - 1)

    with torch.inference_mode():
        row["offload_verify_ms"] = _events_ms(lambda: off_step(gamma + 1), 3, warmup=1)
        row["offload_ar_ms"] = _events_ms(lambda: off_step(1), 3, warmup=1)
    row["pcie_floor_ms"] = kv_bytes / pcie / 1e6


def reprice(rows: list[dict], acceptance: dict, gamma: int, gamma_draft: int, host_ms: float = 0.0) -> list[dict]:
    """ms/token of ar and of triforce (ngram -> retrieval -> full; on-chip and offloaded) from the measured
    costs and per-token acceptances {"T=0": (a_full, a_retr[, a_head]), ...}: cost_model.predict_ms, the i.i.d.
    acceptance model; with a_head and a measured head level, also a draft head's stacks: head -> full (gamma_draft
    drafts) and head -> retrieval -> full (the head's acceptance taken as the same against either level).
    `host_ms`: host time per forward outside the graph (sampling, the token's copy), added to every forward, ar's
    and each drafted token's included. Rows without on-chip costs (offloaded only) are skipped."""
    from triforce.speculation.cost_model import Boundary, Step, ms_per_token, predict_ms

    out = []
    for r in rows:
        if "verify_ms" not in r:
            continue
        for temp, (a_full, a_retr, *a_head) in acceptance.items():
            cost_retr = {gamma_draft + 1: r[f"retrieval_{gamma_draft + 1}_ms"] + host_ms}
            cost_full = {gamma + 1: r["verify_ms"] + host_ms, gamma_draft + 1: r["verify_ms"] + host_ms}
            tri = predict_ms(cost_full, cost_retr, a_full, a_retr, gamma, gamma_draft)
            ar = r["ar_graph_ms"] + host_ms
            rec = {"shape": r["shape"], "context": r["context"], "temperature": temp, "ar_ms": ar,
                   "triforce_ms": tri, "speedup": ar / tri}
            if a_head and "head_1_ms" in r:
                head = r["head_1_ms"] + host_ms
                two = ms_per_token(head, [Step(cost_full, Boundary.iid(a_head[0]), gamma_draft)])
                three = ms_per_token(head, [Step(cost_retr, Boundary.iid(a_head[0]), gamma_draft),
                                            Step(cost_full, Boundary.iid(a_full), gamma)])
                rec.update(head_full_ms=two, head_full_speedup=ar / two, head_retrieval_ms=three,
                           head_retrieval_speedup=ar / three)
            if "offload_verify_ms" in r:
                off = predict_ms({gamma + 1: r["offload_verify_ms"] + host_ms}, cost_retr, a_full, a_retr, gamma,
                                 gamma_draft)
                off_ar = r["offload_ar_ms"] + host_ms
                rec.update(offload_ar_ms=off_ar, offload_triforce_ms=off, offload_speedup=off_ar / off)
            out.append(rec)
    return out


def print_repriced(priced: list[dict]) -> None:
    for r in priced:
        print(f"{r['shape']:10} {r['context']:>7} {r['temperature']:>6} ar {r['ar_ms']:.2f} triforce "
              f"{r['triforce_ms']:.2f} ms/token ({r['speedup']:.2f}x)"
              + (f"; offloaded ar {r['offload_ar_ms']:.0f} triforce {r['offload_triforce_ms']:.1f} "
                 f"({r['offload_speedup']:.1f}x)" if "offload_ar_ms" in r else "")
              + (f"; head,full {r['head_full_ms']:.2f} ({r['head_full_speedup']:.2f}x), head,retrieval,full "
                 f"{r['head_retrieval_ms']:.2f} ({r['head_retrieval_speedup']:.2f}x)" if "head_full_ms" in r else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_costs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama2-7b,llama3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--contexts", default="32768,65536,131072", help="context lengths (skipped where K/V do not fit)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--gamma-draft", type=int, default=3)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--offload", action="store_true", help="also time the offloaded cache (pinned host memory)")
    p.add_argument("--breakdown", action="store_true", help="also time each part of a forward alone")
    p.add_argument("--sweep", action="store_true", help="--breakdown and the decode kernel's launch settings")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="at the first context: a real prefill, then ar and triforce for N tokens (host costs included)")
    p.add_argument("--acceptance", default="",
                   help="per-token acceptances for re-pricing: 'T=0:A_FULL/A_RETR,T=0.6:A_FULL/A_RETR' (a third "
                        "value, /A_HEAD, also prices the draft head's stacks)")
    p.add_argument("--json", metavar="FILE", help="write every measurement here")
    p.add_argument("--reprice", metavar="FILE",
                   help="no GPU needed: re-price the rows of an earlier --json FILE with --acceptance (and --host-ms)")
    p.add_argument("--host-ms", type=float, default=0.0, help="host time per forward added when re-pricing")
    p.add_argument("--kernel-sweep", action="store_true",
                   help="only the decode kernel alone at --contexts, both KV-head counts, every launch setting")
    args = p.parse_args(argv)
    acceptance = {}
    for part in filter(None, args.acceptance.split(",")):
        temp, pair = part.split(":")
        acceptance[temp] = tuple(float(x) for x in pair.split("/"))
    if args.reprice:
        with open(args.reprice) as f:
            earlier = json.load(f)
        print_repriced(reprice(earlier["rows"], acceptance, earlier["gamma"], earlier["gamma_draft"], args.host_ms))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark needs one", file=sys.stderr)
        return 2

    def log(m):
        print(m, file=sys.stderr, flush=True)

    props = torch.cuda.get_device_properties(0)
    hbm, pcie = hbm_bandwidth(), pcie_bandwidth()
    info = {"gpu": props.name, "memory_GiB": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
            "torch": torch.__version__, "hbm_copy_GBps": hbm, "pcie_h2d_GBps": pcie}
    log(json.dumps(info))
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.kernel_sweep:
        kernel = decode_kernel_sweep(contexts, hbm, log)
        if args.json:
            atomic_write(Path(args.json), json.dumps({"device": info, "kernel": kernel}, indent=1))
        return 0
    rows = []
    result = {"device": info, "gamma": args.gamma, "gamma_draft": args.gamma_draft, "budget": args.budget,
              "rows": rows, "repriced": [], "acceptance": acceptance}
    for name in args.shapes.split(","):
        rows += measure_shape(name, contexts, args.gamma, args.gamma_draft, args.budget, args.offload, hbm, pcie, log,
                              "sweep" if args.sweep else args.breakdown, args.generate)
        if args.json:  # after each shape: a run cut short keeps what it measured
            atomic_write(Path(args.json), json.dumps(result, indent=1))
    result["repriced"] = priced = reprice(rows, acceptance, args.gamma, args.gamma_draft, args.host_ms) if acceptance else []
    if args.json:
        atomic_write(Path(args.json), json.dumps(result, indent=1))
    print(f"{info['gpu']}: HBM copy {hbm:.0f} GB/s, PCIe H2D {pcie:.1f} GB/s")
    print(f"{'shape':10} {'ctx':>7} {'ar eager':>9} {'ar graph':>9} {'floor':>7} {'x':>5} {'verify':>7} "
          f"{'retr1':>6} {'retrN':>6} {'build':>6} {'off.ver':>8} {'pcie fl':>8}")
    for r in rows:
        print(f"{r['shape']:10} {r['context']:>7} {r['ar_eager_ms']:9.2f} {r['ar_graph_ms']:9.2f} "
              f"{r['hbm_floor_ms']:7.2f} {r['ar_over_floor']:5.2f} {r['verify_ms']:7.2f} {r['retrieval_1_ms']:6.2f} "
              f"{r[f'retrieval_{args.gamma_draft + 1}_ms']:6.2f} {r['retrieval_build_ms']:6.1f} "
              f"{r.get('offload_verify_ms', math.nan):8.1f} {r.get('pcie_floor_ms', math.nan):8.1f}")
    print_repriced(priced)
    return 0


if __name__ == "__main__":
    sys.exit(main())
