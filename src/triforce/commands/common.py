"""What the commands share: argument types, the model / speculation / stack argument groups, and the
SpecConfig and StackSpec they make from the parsed options (checked before any model loads)."""
from __future__ import annotations

import argparse

from .. import kernels
from ..config import DEFAULT_KV_DTYPE, FLOAT_KV_DTYPES, KV_DTYPES, WEIGHTS, WEIGHTS_HELP, kv_dtype_name
from ..errors import TriforceError
from ..speculation.settings import SpecConfig
from ..speculation.stack import METHOD_DOC, METHODS, StackSpec, method_stack


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH",
                   help="a Hugging Face model directory (config.json + *.safetensors) or a .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct, RoPE base 4e5, 32K context)")
    g.add_argument("--rope-theta", type=float, metavar="BASE", help="override the RoPE base (e.g. 4e5)")
    g.add_argument("--max-context", type=positive_int, metavar="N", help="override the maximum context in tokens")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights and activations dtype (default float32 on CPU: faster than bf16 on CPUs without "
                        "AMX; bfloat16 on CUDA)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help=f"the target's KV cache dtype (its stored keys and values only; ar and every stack use "
                        f"it, so the output stays exact for it): default {DEFAULT_KV_DTYPE} with float32 weights, bf16 "
                        f"on a CPU with AMX tiles or an AMD one with AVX512-BF16 (its verifications and prefill run on their dot "
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
    g.add_argument("--threads", type=positive_int, metavar="N",
                   help="CPU threads (default: PyTorch's, one per core; peers in `bench` use as many). Use fewer "
                        "when other work shares the cores: a parallel step waits for its slowest thread, so a "
                        "busy core can make each step many times slower")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="where converted GGUF models and the compiled CPU kernels are cached (default "
                        "$TRIFORCE_CACHE_DIR or ~/.cache/triforce)")


def add_spec_args(p: argparse.ArgumentParser, tuned: bool = True) -> None:
    """The speculation options; `tuned`: also --no-tuned (generate and bench take tuned flags; tune makes them)."""
    d = SpecConfig()
    g = p.add_argument_group("speculation (defaults measured on the embedded model: docs/triforce.md)")
    # --gamma, --gamma-draft and --budget default to None: a named triforce run without them takes this
    # machine's tuned values where `triforce tune` recorded some (tuning/flags.py), else SpecConfig's
    g.add_argument("--gamma", type=positive_int, default=None, metavar="N",
                   help=f"named methods: tokens drafted per verification by the full target (default {d.gamma}, or "
                        f"this machine's tuned value for triforce: `triforce tune`)")
    g.add_argument("--gamma-draft", type=positive_int, default=None, metavar="N",
                   help=f"triforce: tokens the bottom drafter proposes per retrieval-level verification (default "
                        f"{d.gamma_draft}, or the tuned value)")
    g.add_argument("--draft", default=d.draft, metavar="KIND",
                   help="bottom drafter of triforce: ngram (default), head (a trained draft head, --head), streaming "
                        "(the target with a StreamingLLM cache), or PATH of a small model sharing the target's tokenizer; also the model of a "
                        "'draft' level")
    g.add_argument("--head", metavar="DIR", default="",
                   help="the draft head of a 'head' level: a directory made by `triforce train-drafter` (default: "
                        "the head that ships for the embedded model)")
    g.add_argument("--budget", type=positive_int, default=None, metavar="N",
                   help=f"retrieval (and H2O) cache budget in tokens per layer and KV head, for a retrieval or h2o level "
                        f"without :BUDGET (default {d.budget}, or the tuned value for triforce)")
    if tuned:
        g.add_argument("--no-tuned", action="store_true",
                       help="ignore this machine's tuned flags (`triforce tune`) and use the defaults above")
    g.add_argument("--chunk-size", type=positive_int, default=d.chunk_size, metavar="N",
                   help=f"retrieval chunk size (default {d.chunk_size})")
    g.add_argument("--recent", type=int, default=d.recent, metavar="N",
                   help=f"newest tokens the retrieval and H2O caches always keep (default {d.recent})")
    g.add_argument("--rebuild-every", type=positive_int, default=d.rebuild_every, metavar="N",
                   help=f"rebuild the retrieval and H2O caches after N new tokens (default {d.rebuild_every})")
    g.add_argument("--draft-weights", choices=("bf16", "fp32"), default=d.draft_weights,
                   help="weights of the target when it drafts (retrieval and streaming levels): bf16 (default; "
                        "half the bytes per forward, needs the CPU kernels, else fp32) or fp32. The output "
                        "is exact either way: the full level verifies with the fp32 weights")
    g.add_argument("--draft-kv-dtype", choices=FLOAT_KV_DTYPES, default=None,
                   help=f"KV cache dtype of the drafting levels (retrieval, streaming, a draft model; default "
                        f"{d.draft_kv_dtype} on CPU, bf16 on a CPU with AMX tiles or an AMD one with AVX512-BF16, the weights' dtype on CUDA). The output "
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
    g.add_argument("--window", type=positive_int, default=d.window, metavar="N",
                   help=f"StreamingLLM recent window, for a streaming level without :BUDGET (default {d.window})")


def add_stack_args(p: argparse.ArgumentParser) -> None:
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


def default_draft_kv(args) -> str:
    """CPU: the measured default (config.DEFAULT_DRAFT_KV_DTYPE), bf16 where the CPU kernels run a bf16 cache's
    attention on dot products faster than fp16's (kernels.bf16_cache_faster), as for the target's cache (loading.default_kv_dtype): a drafting level's
    multi-token forwards then run on them (AMX tiles: 5 tokens over a 4K cache 11.1 ms instead of 13.9; AMD Zen 5's
    AVX512-BF16: 7.5 instead of 9.2, and the 32K bench's retrieval forwards 8.3-8.7 ms instead of 9.3-9.6);
    CUDA: the weights' dtype (the GPU attention kernel reads K/V in the activations' dtype: another would be
    converted every forward)."""
    if not str(getattr(args, "device", "cpu")).startswith("cuda"):
        # (not built here: a bad model is refused before the kernels are compiled)
        return "bf16" if kernels.bf16_cache_faster(build=False) else SpecConfig.draft_kv_dtype
    return kv_dtype_name(getattr(args, "dtype", None) or "bfloat16")


def spec_config_from_args(args) -> tuple[SpecConfig, str | None]:
    """-> (config, path of a draft model or None)."""
    draft, path = args.draft, None
    if draft not in ("ngram", "head", "streaming"):
        path, draft = draft, "draft"
    d = SpecConfig()
    cfg = SpecConfig(gamma=d.gamma if args.gamma is None else args.gamma,
                     gamma_draft=d.gamma_draft if args.gamma_draft is None else args.gamma_draft, draft=draft,
                     budget=d.budget if args.budget is None else args.budget,
                     chunk_size=args.chunk_size, recent=args.recent, rebuild_every=args.rebuild_every,
                     sink=args.sink, window=args.window, prefill_chunk=args.prefill_chunk,
                     ngram_shortcut=args.ngram_shortcut,
                     adapt=getattr(args, "adapt", True) and args.gamma is None and args.gamma_draft is None,
                     draft_weights=args.draft_weights, draft_kv_dtype=args.draft_kv_dtype or default_draft_kv(args),
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


def planned_stack(args) -> tuple[SpecConfig, str | None, StackSpec, str] | None:
    """The options of a command that runs a stack -> (config, draft path, stack, its name); None where
    --print-stack asked only for the stack, which is then printed (the command is done)."""
    config, draft_path = spec_config_from_args(args)
    stack, name = stack_from_args(args, config, draft_path)
    if args.print_stack:
        print(stack)
        return None
    return config, draft_path, stack, name




def byte_size(s: str) -> int:
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
