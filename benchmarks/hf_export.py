"""The model as a plain Hugging Face directory, with the long-context profile triforce runs it with, for peers
that load only such directories (vLLM).

    python benchmarks/hf_export.py DIR [--model FILE.gguf]

transformers will not save_pretrained a model it loaded from a GGUF file, so the weights come from triforce's own
dequantized conversion (loading.converted_gguf_dir: fp32, the same numbers triforce computes with in fp32) and go
into a plain LlamaForCausalLM. The embedded model gets the RoPE base and context triforce gives it
(loading.DEFAULT_ROPE_THETA, DEFAULT_MAX_CONTEXT); without them a peer would run it at its native 8K profile and
compute different logits past a few tokens.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from triforce.errors import TriforceError

PROFILE_FILE = "triforce_export.json"  # what the directory was exported from, and with which profile
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def export_hf(out: str | Path, model: str | None = None, *, rope_theta: float | None = None,
              max_context: int | None = None, cache_dir=None, progress: bool = True) -> Path:
    """Write `out` (config, fp32 safetensors, tokenizer) for `model` (None: the embedded default, with its
    long-context profile) and return it. An existing export of the same file with the same profile is reused.
    Written into a temporary folder beside `out` and renamed into place: a reader never sees a partial one."""
    import torch
    import transformers

    from triforce import storage
    from triforce.loading import DEFAULT_MAX_CONTEXT, DEFAULT_ROPE_THETA, converted_gguf_dir, gguf_file_of

    out = Path(out).expanduser()
    gguf = gguf_file_of(model)
    if gguf is None:
        raise TriforceError(f"{model} is already a Hugging Face directory: give it to the peer as it is")
    if model is None:
        rope_theta = DEFAULT_ROPE_THETA if rope_theta is None else rope_theta
        max_context = DEFAULT_MAX_CONTEXT if max_context is None else max_context
    st = gguf.stat()
    profile = {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
               "rope_theta": rope_theta, "max_context": max_context}
    try:
        if json.loads((out / PROFILE_FILE).read_text()) == profile:
            return out
    except (OSError, ValueError):
        pass
    if out.exists():
        raise TriforceError(f"{out} exists and is not an export of {gguf.name} with this profile: remove it or "
                            f"choose another directory")
    source = converted_gguf_dir(gguf, cache_dir, progress=progress, weights=True)
    config = transformers.AutoConfig.from_pretrained(str(source))
    if config.model_type != "llama":
        raise TriforceError(f"{gguf.name} is a {config.model_type} model; the export writes Llama models only")
    if rope_theta is not None:
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": float(rope_theta)}
    if max_context is not None:
        config.max_position_embeddings = int(max_context)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(source), config=config, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    storage.remove_stale_temporaries(out.parent)  # a killed export's half-written folder (its weights: 0.5 GB)
    with storage.atomic_directory(out) as tmp:
        hf.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        # rope_theta at the top level too: readers with transformers 4.x do not know rope_parameters
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / PROFILE_FILE).write_text(json.dumps(profile, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/hf_export.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the directory to write")
    p.add_argument("--model", help="a .gguf file (default: the embedded model, with its long-context profile)")
    p.add_argument("--rope-theta", type=float, help="the RoPE base (default: the model's profile)")
    p.add_argument("--max-context", type=int, help="max_position_embeddings (default: the model's profile)")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.out, args.model, rope_theta=args.rope_theta, max_context=args.max_context)
    except TriforceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
