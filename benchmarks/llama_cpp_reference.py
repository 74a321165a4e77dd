"""Compare triforce with llama.cpp (llama-cpp-python) on one GGUF file: the same tokens, perplexity computed
the same way, teacher-forced argmax agreement, and a greedy continuation.

    python benchmarks/llama_cpp_reference.py --model /tmp/g3/gemma-3-270m-q4_k_m.gguf \
        --text-file /usr/share/common-licenses/GPL-3 --tokens 2048 --greedy-prompt 1000 --greedy-new 64

Needs llama-cpp-python (`./install.sh llama`). What it computes, for both:
- the text tokenized with BOS first (llama.cpp: `Llama.tokenize(text, add_bos=True)`; triforce:
  `bench.perplexity.model_tokens`, what `triforce perplexity` feeds), cut to --tokens; the two id lists are
  compared first (the rest runs on triforce's ids either way);
- one forward over the --tokens tokens (llama.cpp: n_ctx = --tokens, batches of 512, logits for every
  position, KV cache --llama-kv (f32 unless asked); triforce: prefill chunks of 512, KV cache --kv-dtype
  (fp32 unless asked));
- NLL_i = -log softmax(logits_i)[ids[i + 1]] in float64, for i = 0 .. N-2;
  "full" = exp(mean of all N-1), "second half" = exp(mean over i >= N/2), which are the predictions
  llama.cpp's `llama-perplexity -c N` scores in a window of N (it skips the first half of each window);
- argmax agreement of the two models' logits over those positions, and the largest |logit difference|;
- greedy: the first --greedy-prompt tokens as the prompt, --greedy-new tokens by argmax in each (llama.cpp
  feeding its own choices back one at a time), with the top-2 margins where they part.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
from triforce.caches import new_cache


def nll_and_argmax(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (-log softmax(logits)[target] in float64, argmax) per row, 128 rows at a time."""
    nll, arg = [], []
    for s in range(0, len(targets), 128):
        x = logits[s:s + 128].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        logz = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
        nll.append(logz - x[np.arange(len(x)), targets[s:s + 128]])
        arg.append(x.argmax(axis=1))
    return np.concatenate(nll), np.concatenate(arg)


def margin(row: np.ndarray) -> float:
    top = np.sort(row.astype(np.float64))[-2:]
    return float(top[1] - top[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text-file", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="fp32", help="triforce's KV cache dtype (default fp32)")
    ap.add_argument("--llama-kv", choices=("f32", "f16"), default="f32",
                    help="llama.cpp's KV cache type (default f32, as triforce's here; llama.cpp's own default is f16)")
    ap.add_argument("--greedy-prompt", type=int, default=1000)
    ap.add_argument("--greedy-new", type=int, default=64)
    ap.add_argument("--llama-model", default=None,
                    help="the file llama.cpp loads (default --model), e.g. an F32 copy from benchmarks/gguf_to_f32.py")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import Llama

    from triforce.commands.perplexity import model_tokens
    from triforce.generate import generate_ar
    from triforce.loading import load_model
    from triforce.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    text = open(args.text_file, encoding="utf-8").read()
    n = args.tokens
    out: dict = {"model": args.model, "llama_cpp_model": args.llama_model or args.model, "tokens": n,
                 "kv_dtype": args.kv_dtype, "llama_cpp_kv": args.llama_kv}

    ours = load_model(args.model, kv_dtype=args.kv_dtype, max_context=max(n, args.greedy_prompt + args.greedy_new),
                      progress=False)
    ids = model_tokens(ours.tokenizer, text)[:n]
    kv = llama_cpp.GGML_TYPE_F32 if args.llama_kv == "f32" else llama_cpp.GGML_TYPE_F16
    llm = Llama(model_path=args.llama_model or args.model, n_ctx=n, n_batch=512, logits_all=True, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False,
                type_k=kv, type_v=kv)
    lids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)[:n]
    out["same_token_ids"] = lids == ids
    out["first_token_difference"] = next((i for i, (a, b) in enumerate(zip(lids, ids)) if a != b), None)

    # llama.cpp: one eval of the n tokens, logits for each position
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(ids)
    theirs = llm.scores[: n - 1]  # a view: [n - 1, vocab] float32
    out["llama_cpp_seconds"] = round(time.perf_counter() - t0, 1)
    targets = np.asarray(ids[1:])
    nll_l, arg_l = nll_and_argmax(theirs, targets)

    # triforce: prefill chunks of 512 over the same tokens
    t0 = time.perf_counter()
    model = ours.model
    cache = new_cache(model, n)
    x = torch.tensor([ids])
    nll_t, arg_t, max_diff = [], [], 0.0
    with torch.inference_mode():
        for s in range(0, n - 1, 512):
            e = min(s + 512, n - 1)
            logits = model(x[:, s:e], cache)[0].float().numpy()
            a, b = nll_and_argmax(logits, targets[s:e])
            nll_t.append(a)
            arg_t.append(b)
            max_diff = max(max_diff, float(np.abs(logits - theirs[s:e]).max()))
    out["triforce_seconds"] = round(time.perf_counter() - t0, 1)
    nll_t, arg_t = np.concatenate(nll_t), np.concatenate(arg_t)
    half = n // 2
    for name, nll in (("llama_cpp", nll_l), ("triforce", nll_t)):
        out[f"{name}_ppl_full"] = math.exp(nll.mean())
        out[f"{name}_ppl_second_half"] = math.exp(nll[half:].mean())
    out["argmax_agreement"] = f"{int((arg_l == arg_t).sum())}/{n - 1}"
    out["max_abs_logit_difference"] = max_diff
    out["mean_abs_nll_difference"] = float(np.abs(nll_l - nll_t).mean())

    # greedy continuation of the first --greedy-prompt tokens
    p, new = ids[: args.greedy_prompt], args.greedy_new
    llm.reset()
    llm.eval(p)
    g_l, margins_l = [], []
    for _ in range(new):
        row = np.asarray(llm.scores[llm.n_tokens - 1])
        g_l.append(int(row.argmax()))
        margins_l.append(margin(row))
        llm.eval([g_l[-1]])
    g_t = generate_ar(model, p, new, SamplingParams()).tokens
    # triforce teacher-forced along llama.cpp's greedy path: where would it choose otherwise, and how close
    # to a tie was each model there (top-1 minus top-2 for llama.cpp, top-1 minus llama.cpp's choice for ours)
    seq = p + g_l
    cache = new_cache(model, len(seq))
    x = torch.tensor([seq])
    rows = []
    with torch.inference_mode():
        for s in range(0, len(seq) - 1, 512):
            e = min(s + 512, len(seq) - 1)
            logits = model(x[:, s:e], cache)[0]
            rows.extend(logits[i].float().numpy() for i in range(e - s) if s + i >= len(p) - 1)
    disagree = [(i, margins_l[i], float(r.max() - r[g_l[i]])) for i, r in enumerate(rows) if int(r.argmax()) != g_l[i]]
    out["teacher_forced_on_llama_cpp_greedy"] = f"{new - len(disagree)}/{new} same argmax"
    out["disagreements_(step,llama_cpp_margin,triforce_margin)"] = [(i, round(a, 4), round(b, 4)) for i, a, b in disagree]
    first = next((i for i, (a, b) in enumerate(zip(g_l, g_t)) if a != b), None)
    out["greedy_equal_prefix"] = len(g_l) if first is None else first
    out["greedy_new"] = new
    if first is not None:  # how close to a tie llama.cpp was where they parted
        out["llama_cpp_top2_margin_at_difference"] = margins_l[first]
        out["greedy_llama_cpp"], out["greedy_triforce"] = g_l, g_t
    out["greedy_text_llama_cpp"] = ours.tokenizer.decode(g_l)
    out["greedy_text_triforce"] = ours.tokenizer.decode(g_t)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
