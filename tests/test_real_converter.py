"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py, --outtype f32) from tiny random
Hugging Face models load in triforce to the model transformers runs from the directory they came from:
every RoPE scaling a Llama config can carry (none, Llama 3.x's `llama3`, stored by the converter as a
`rope_freqs` tensor; `yarn`; `linear`), Qwen3 (QK-norm) and Gemma 3 (sandwich norms, `1 + w` norms,
sliding-window layers).

Unlike tests/test_gguf_loading.py, which emulates the converter's layout with gguf-py's GGUFWriter, these
run the converter itself (with its vendored gguf-py) as a user would. It is not a dependency: the tests
skip unless it is found, at $TRIFORCE_LLAMA_CONVERTER (the path of convert_hf_to_gguf.py) or where
`./install.sh converter` unpacks it (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, under the cache
directory's llama-converter/: ${TRIFORCE_CACHE_DIR:-~/.cache/triforce}). The converter needs `sentencepiece`
importable even for tokenizers without a tokenizer.model (the `test` extra has it; `./install.sh converter`
installs it too).

The converter needs a real tokenizer: the tiny models carry the embedded SmolLM2's (its tokenizer.json,
from triforce's cached conversion of the embedded GGUF; the converter recognises its pre-tokenizer as
"smollm"), so their vocabulary is its 49,152 tokens.

Checked per case, all with an fp32 KV cache (the default fp16 cache is a deliberate approximation):
- logits over 450 positions (random token ids; the original context is 64) within 1e-4 of transformers'
  on the HF directory, from the GGUF and from the HF directory;
- 200 greedy tokens after a 250-token prompt identical to transformers' `generate` (from the GGUF);
- the tokenizer rebuilt from the GGUF encodes text as the directory's tokenizer does.
Plus `triforce generate --model X.gguf --json` (the CLI) on one file.

`python tests/test_real_converter.py` prints the measured errors as a Markdown table.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from triforce.caches import new_cache
from triforce.errors import TriforceError

CONVERTER_ENV = "TRIFORCE_LLAMA_CONVERTER"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist `./install.sh converter` unpacks
ORIGINAL_CONTEXT = 64  # the scaled RoPEs' original context: the comparisons run to position 449
TOTAL, PROMPT = 450, 250  # logits over TOTAL positions; greedy: PROMPT tokens then TOTAL - PROMPT new ones
ATOL = 1e-4
THETA = 10000.0
TEXT = ("The GNU General Public License is a free, copyleft license for software and other kinds of works. "
        "Hello world! 1234 \u00e9t\u00e9 \u2014 \U0001f999 <|im_start|> tabs\tand\nnewlines.")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.25,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama / none": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": THETA})),
    "llama / llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_CONTEXT})),
    "llama / yarn": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT})),
    "llama / linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": THETA, "factor": 4.0})),
    "qwen3 / none": ("qwen3", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": THETA})),
    "qwen3 / yarn": ("qwen3", dict(head_dim=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT})),
    # 6 layers: five sliding-window layers (window 32) then a global one, as Gemma 3's pattern; the local RoPE
    # base is llama.cpp's default 1e4 (the converter does not store it); the query scale head_dim ** -0.5, which
    # is what llama.cpp computes (the file has no query_pre_attn_scalar) and what Gemma 3 270M's config says.
    "gemma3 / sliding": ("gemma3", dict(num_hidden_layers=6, head_dim=16, sliding_window=32, query_pre_attn_scalar=16,
                                        num_key_value_heads=1, tie_word_embeddings=True,
                                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})),
}


def find_converter() -> tuple[Path | None, str]:
    """-> (convert_hf_to_gguf.py, "") or (None, why the tests skip)."""
    env = os.environ.get(CONVERTER_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            return None, f"${CONVERTER_ENV} = {env} is not a file"
    else:
        from triforce.storage import cache_root

        root = cache_root() / "llama-converter"
        found = sorted(glob.glob(str(root / "llama_cpp_python-*" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")))
        if not found:
            return None, (f"llama.cpp's convert_hf_to_gguf.py not found: run ./install.sh converter "
                          f"(unpacks it under {root}) or set ${CONVERTER_ENV} to its path")
        path = Path(found[-1])
    if importlib.util.find_spec("sentencepiece") is None:
        return None, "llama.cpp's converter imports sentencepiece: ./install.sh converter (or pip install sentencepiece)"
    return path, ""


CONVERTER, WHY_NOT = find_converter()
# slow: each case converts a model and runs 450 positions and 200 greedy tokens (minutes in all)
pytestmark = [pytest.mark.skipif(CONVERTER is None, reason=WHY_NOT), pytest.mark.slow]


def tokenizer_dir() -> Path:
    """The embedded SmolLM2's tokenizer as a Hugging Face directory (triforce's cached conversion)."""
    from triforce.errors import TriforceError
    from triforce.loading import resolve_model_dir

    try:
        directory, *_ = resolve_model_dir(None, weights=False, progress=False)
    except TriforceError as e:
        pytest.skip(f"the tiny models borrow the embedded model's tokenizer: {e}")
    return directory


def make_hf_dir(out: Path, arch: str, overrides: dict, seed: int = 0) -> Path:
    """A tiny random model of `arch` saved with save_pretrained, with the embedded model's tokenizer."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[arch]
    config = cls[0](**dict(SMALL, **overrides))
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # norm weights start at 1 (Gemma: at 0): make them random so that they are tested
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(-0.5, 0.5) if arch == "gemma3" else weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(out))
    for f in tokenizer_dir().iterdir():
        if f.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def convert(hf_dir: Path, out: Path) -> Path:
    """Run llama.cpp's converter as a user would: `python convert_hf_to_gguf.py DIR --outtype f32 --outfile OUT`."""
    cmd = [sys.executable, str(CONVERTER), str(hf_dir), "--outtype", "f32", "--outfile", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return out


def gguf_summary(path: Path) -> dict:
    """The RoPE-related keys and tensors the converter wrote."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    keys = {k: f.contents() for k, f in reader.fields.items() if ".rope." in k or "sliding_window" in k}
    return dict(keys, tensors=[t.name for t in reader.tensors if not t.name.startswith("blk.")])


def file_rope_reference(ref, path: Path):
    """transformers' model with its RoPE frequencies as llama.cpp computes them from the file's `rope_freqs`
    (base ** (-2i / d) / factor_i, in fp32), or None if the file has none. The converter computes the llama3
    factors in float64 and stores them in fp32, so these frequencies differ from transformers' own llama3
    ones by about an fp32 ulp: a model in its own right, which the file holds exactly."""
    import copy

    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    if "rope_freqs.weight" not in tensors:
        return None
    factors = torch.from_numpy(np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).ravel().copy())
    ref = copy.deepcopy(ref)
    rot = ref.model.rotary_emb
    dim, base = 2 * factors.numel(), ref.config.rope_parameters["rope_theta"]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)) / factors
    rot.inv_freq.copy_(inv)
    rot.original_inv_freq = inv.clone()
    return ref


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's (llama-cpp-python's) logits for `ids`, one eval, with an fp32 KV cache (its default is fp16)."""
    from llama_cpp import GGML_TYPE_F32, Llama

    llm = Llama(model_path=str(path), n_ctx=len(ids), n_batch=len(ids), logits_all=True, n_threads=2,
                n_threads_batch=2, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))


@torch.inference_mode()
def compare(case: str, tmp: Path, with_llama_cpp: bool = False) -> dict:
    """Convert the case's model and compare triforce (GGUF and HF directory) with transformers."""
    import transformers

    from triforce.generate import generate_ar
    from triforce.loading import load_model
    from triforce.sampling import SamplingParams

    arch, overrides = CASES[case]
    hf_dir = make_hf_dir(tmp / "hf", arch, overrides)
    path = convert(hf_dir, tmp / "model.gguf")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    refused = None
    try:
        from_gguf = load_model(path, kv_dtype="fp32", cache_dir=tmp / "cache", progress=False)
    except TriforceError as e:  # a gemma3 file with a BPE tokenizer: refused; its weights still compared
        refused, from_gguf = str(e), weights_only(path)
    from_dir = load_model(hf_dir, kv_dtype="fp32", cache_dir=tmp / "cache", progress=False)

    ids = torch.randint(0, SMALL["vocab_size"], (1, TOTAL), generator=torch.Generator().manual_seed(0))
    want = ref(ids).logits[0]
    out = {"case": case, "gguf": gguf_summary(path), "rope": from_gguf.config.rope}
    results = {}
    for name, loaded in (("gguf", from_gguf), ("dir", from_dir)):
        model = loaded.model
        results[name] = got = model(ids, new_cache(model, TOTAL))[0]
        err = (got - want).abs()
        out[f"{name}_max_err"] = err.max().item()
        out[f"{name}_max_err_past"] = err[ORIGINAL_CONTEXT:].max().item()
        out[f"{name}_argmax"] = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    file_ref = file_rope_reference(ref, path)
    if file_ref is not None:
        out["gguf_max_err_file_rope"] = (results["gguf"] - file_ref(ids).logits[0]).abs().max().item()
    if with_llama_cpp:
        theirs = llama_cpp_logits(path, ids[0].tolist())
        out["llama_cpp_max_err"] = (theirs - want).abs().max().item()
        out["llama_cpp_argmax"] = (theirs.argmax(-1) == want.argmax(-1)).float().mean().item()
    prompt = ids[:, :PROMPT]
    new = TOTAL - PROMPT
    greedy = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, PROMPT:].tolist()
    ours = generate_ar(from_gguf.model, prompt[0].tolist(), new, SamplingParams()).tokens
    out["greedy_want"], out["greedy_got"] = greedy, ours
    out["greedy_equal"] = next((i for i, (a, b) in enumerate(zip(greedy, ours)) if a != b), min(len(greedy), len(ours)))
    want_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    out["tokens_want"] = want_tok(TEXT)["input_ids"]
    out["tokens_got"] = None if refused else from_gguf.tokenizer(TEXT)["input_ids"]
    out["refused"] = refused
    return out


def weights_only(path: Path):
    """The GGUF's model without its tokenizer (load_model refuses the file for its tokenizer)."""
    from types import SimpleNamespace

    from triforce.config import ModelConfig
    from triforce.loading import build_model
    from triforce.loading.gguf_file import read_gguf

    hf, sd = read_gguf(path, progress=False)
    cfg = ModelConfig.from_hf(hf)
    model = build_model(cfg, sd)
    model.kv_dtype = "fp32"
    return SimpleNamespace(model=model, config=cfg, tokenizer=None)


# The llama3 GGUF holds its RoPE factors in fp32 (file_rope_reference): against transformers' own llama3
# frequencies its logits differ by more than ATOL where positions are large (measured: 1.9e-4 at position
# ~430 of this random model, whose attention is sharp). It must still
# be within ATOL of the model the file holds, and within this of transformers' model.
ATOL_LLAMA3_FILE = 1e-3
# Two tokens whose logits may each be off by that much may swap places in a greedy run.
NEAR_TIE = 2 * ATOL_LLAMA3_FILE


@pytest.mark.parametrize("case", list(CASES))
def test_converter_gguf_matches_transformers(tmp_path, case):
    r = compare(case, tmp_path)
    print(f"\n{case}: GGUF max |logit error| {r['gguf_max_err']:.2e} (past position {ORIGINAL_CONTEXT}: "
          f"{r['gguf_max_err_past']:.2e}), HF directory {r['dir_max_err']:.2e}; greedy {r['greedy_equal']}/"
          f"{TOTAL - PROMPT} equal; file: {r['gguf']}")
    rope = CASES[case][1]["rope_parameters"]
    assert r["dir_max_err"] <= ATOL, r
    if rope.get("rope_type") == "llama3":  # the converter stores llama3 as per-pair factors
        assert "rope_freqs.weight" in r["gguf"]["tensors"] and r["rope"].freq_factors is not None
        print(f"  against transformers with the file's fp32 RoPE factors: {r['gguf_max_err_file_rope']:.2e}")
        assert r["gguf_max_err_file_rope"] <= ATOL, r
        assert r["gguf_max_err"] <= ATOL_LLAMA3_FILE, r
    else:
        assert "rope_freqs.weight" not in r["gguf"]["tensors"]
        assert r["rope"].type == (rope.get("rope_type") or "default"), r["rope"]
        assert r["gguf_max_err"] <= ATOL, r
    assert r["greedy_got"] == r["greedy_want"]
    if case.startswith("gemma3"):
        # transformers rebuilds a gemma3 GGUF's tokenizer as Gemma's SentencePiece one whatever
        # tokenizer.ggml.model says; this tiny file carries a BPE ("gpt2") tokenizer, which no real Gemma 3
        # file does: load_model refuses it, naming the tokenizer, instead of tokenizing wrongly.
        assert r["refused"] and "'gpt2' tokenizer" in r["refused"], r["refused"]
    else:
        assert r["refused"] is None and r["tokens_got"] == r["tokens_want"]


def test_cli_generate_on_converter_gguf(tmp_path):
    """`triforce generate --model X.gguf --json` (the CLI, a fresh process, fp32 KV cache) gives the greedy
    tokens transformers gives on the HF directory, for a text prompt past the original context (up to a swap where
    transformers' two best tokens are a near-tie, past which the texts are not compared)."""
    import transformers

    arch, overrides = CASES["llama / llama3"]
    hf_dir = make_hf_dir(tmp_path / "hf", arch, overrides)
    path = convert(hf_dir, tmp_path / "model.gguf")
    prompt = " ".join([TEXT] * 6)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert ids.shape[1] > ORIGINAL_CONTEXT
    new = 100
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                       return_dict_in_generate=True)
    want = out.sequences[0, ids.shape[1]:].tolist()
    cmd = [sys.executable, "-m", "triforce", "generate", "--model", str(path), "--prompt", prompt, "--method", "ar",
           "--max-new-tokens", str(new), "--kv-dtype", "fp32", "--cache-dir", str(tmp_path / "cache"), "--json",
           "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["prompt_tokens"] == ids.shape[1]
    n = len(got["token_ids"])
    same = next((i for i, (a, b) in enumerate(zip(got["token_ids"], want)) if a != b), n)
    if same < n:
        # Two runs of fp32 arithmetic in different orders may pick different tokens only where transformers' two
        # candidates are within rounding of each other; past that point the texts differ and are not compared.
        logits = out.logits[same][0]
        margin = float(logits[want[same]] - logits[got["token_ids"][same]])
        assert margin < NEAR_TIE, (f"greedy ids differ at token {same} of {n}, where transformers' logit for its "
                                   f"token leads ours by {margin:.2e} (a near-tie is < {NEAR_TIE})")
        return
    if n < new:  # stopped at an end-of-sequence token, which transformers (eos_token_id=None) went past
        assert got["finish_reason"] == "eos" and want[n] == SMALL["eos_token_id"], got


def main() -> None:
    import tempfile

    if CONVERTER is None:
        sys.exit(WHY_NOT)
    with_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    print(f"converter: {CONVERTER}\n")
    print(f"| model / RoPE | what the converter wrote | triforce on the GGUF: max \\|logit err\\| (positions >= "
          f"{ORIGINAL_CONTEXT}) | triforce on the HF dir | argmax = transformers (GGUF) | greedy {TOTAL - PROMPT} "
          f"tokens equal (GGUF) | tokenizer from the GGUF equal |" + (" llama.cpp on the GGUF (fp32 KV cache): max \\|logit err\\| |"
                                                                     if with_llama_cpp else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if with_llama_cpp else ""))
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            r = compare(case, Path(tmp), with_llama_cpp=with_llama_cpp)
        wrote = ", ".join(f"`{k.split('.', 1)[1]}` = {v}" for k, v in r["gguf"].items() if k != "tensors")
        if "rope_freqs.weight" in r["gguf"]["tensors"]:
            wrote += (", " if wrote else "") + "`rope_freqs.weight`"
        file_rope = (f"; {r['gguf_max_err_file_rope']:.1e} against the file's fp32 RoPE factors"
                     if "gguf_max_err_file_rope" in r else "")
        print(f"| {case} | {wrote or '-'} | {r['gguf_max_err']:.1e} ({r['gguf_max_err_past']:.1e}){file_rope} "
              f"| {r['dir_max_err']:.1e} | {100 * r['gguf_argmax']:.1f}% | {r['greedy_equal']}/{TOTAL - PROMPT} "
              f"| {'yes' if r['tokens_got'] == r['tokens_want'] else 'NO'} |"
              + (f" {r['llama_cpp_max_err']:.1e} |" if with_llama_cpp else ""), flush=True)


if __name__ == "__main__":
    main()
