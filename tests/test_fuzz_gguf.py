"""GGUF files fuzzed (Hypothesis): byte flips, overwritten fields and truncations of a tiny complete GGUF
file (a random llama with a byte-level BPE tokenizer, 350 KB, the header about 3.4 KB) given to the loader.

Each damaged file must load (a flip in a weight, or in a value the loader does not read) or be refused
with a TriforceError of one line that names the file and holds none of numpy's, torch's or Python's wording
(a file-reading error: "cannot read GGUF file FILE: PART: DETAIL (the file looks truncated|corrupt: ...)",
test_gguf_damage.py has a test per damage class); never another exception, never a hang (an alarm
stops an example after ALARM_S), never a large allocation (the address space is capped at its size
plus ALLOC_CAP while an example runs: a multi-GB allocation fails there and the test names it), and a
refused file leaves no model entry and no temporary in the cache directory.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import gguf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_gguf_loading import convert, saved
from triforce.errors import TriforceError
from triforce.loading import load_model
from triforce.loading.gguf_file import check_gguf_architecture, gguf_architecture

ALARM_S = 30  # one example takes about 0.05 s; a loaded host a few times that
# Words of numpy's, torch's and Python's own errors, which must not reach the user.
JARGON = re.compile(r"index|axis|reshape|dtype|divisor|buffer|traceback|numpy|torch|ndarray|out of bounds|"
                    r"codec|invalid literal|object has no|NoneType", re.IGNORECASE)
# A GGUF reading error (gguf_check.damaged), and the two that carry no verdict.
FORM = re.compile(r"cannot read GGUF file (?P<path>\S+): (?P<part>.+?): (?P<detail>.+) "
                  r"\(the file looks (?P<verdict>truncated|corrupt): re-download or re-convert it\)")
PLAIN_FORM = re.compile(r"cannot read GGUF file \S+: the header: (not a GGUF file|GGUF version 1)\b.*")


def assert_clear(message: str, path: Path) -> None:
    """A refusal's message: one line naming the file, no numpy, torch or Python wording, and in the GGUF
    reading error's form where it is one."""
    assert "\n" not in message, message
    assert str(path) in message, message
    assert not JARGON.search(message.replace(str(path), "")), message
    if message.startswith("cannot read GGUF file"):
        assert FORM.fullmatch(message) or PLAIN_FORM.fullmatch(message), message
ALLOC_CAP = 1 << 30  # more address space than one example may take: far below a multi-GB allocation


def _tokenizer(w: gguf.GGUFWriter) -> None:
    """A byte-level BPE tokenizer (tokenizer.ggml.model gpt2, as in the embedded SmolLM2 file) of 96 tokens."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ġt"])
    w.add_token_types([1] * 96)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)


class Sample(tuple):
    """(the file's bytes, the offset of its tensor data), shown briefly in Hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<tiny GGUF file: {len(self[0])} bytes, header {self[1]}>"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> "Sample":
    """The file's bytes and the offset of its tensor data (the end of the header)."""
    tmp = tmp_path_factory.mktemp("fuzz-gguf")
    hf_dir, _ = saved(tmp, "llama")
    path = convert(hf_dir, tmp / "tiny.gguf", extra=_tokenizer)
    load_model(path, cache_dir=tmp / "cache", progress=False)  # the undamaged file loads
    return Sample((path.read_bytes(), gguf.GGUFReader(str(path)).data_offset))


@contextmanager
def bounded(seconds: int, extra_bytes: int):
    """An alarm after `seconds` (a hang fails the example) and the address space capped at the current
    size plus `extra_bytes` (a huge allocation fails with MemoryError)."""
    def on_alarm(*_):
        raise TimeoutError(f"the loader took over {seconds} s")

    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    before = resource.getrlimit(resource.RLIMIT_AS)
    old = signal.signal(signal.SIGALRM, on_alarm)
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, before[1]))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, before)
        signal.signal(signal.SIGALRM, old)


def load_or_refuse(data: bytes) -> str:
    """Write `data` as a GGUF file, check its architecture (what the CLI does first) and load it with a
    fresh cache directory: -> 'loaded' or 'refused' (a TriforceError naming the file); anything else fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path, cache = Path(tmp) / "fuzzed.gguf", Path(tmp) / "cache"
        path.write_bytes(data)
        with bounded(ALARM_S, ALLOC_CAP):
            try:
                check_gguf_architecture(path)
                load_model(path, cache_dir=cache, progress=False)
                return "loaded"
            except TriforceError as e:
                message = str(e)
        assert_clear(message, path)
        left = [p.name for p in cache.rglob("*")] if cache.exists() else []
        # a refusal leaves no entry and no temporary (only a conversion's lock file, by design: storage.exclusive)
        assert all(name.endswith(".lock") for name in left), left
        return "refused"


INTERESTING = [0, 1, 2, 7, 8, 9, 12, 13, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@st.composite
def damage(draw, data: bytes, header: int) -> bytes:
    """One of: a truncation (anywhere; most in the header), byte flips in the header, or an 8- or 4-byte
    little-endian field of the header overwritten with a boundary value (counts, lengths, types, offsets)."""
    kind = draw(st.sampled_from(["truncate", "flip", "field"]))
    if kind == "truncate":
        end = draw(st.one_of(st.integers(0, header + 64), st.integers(0, len(data) - 1)))
        return data[:end]
    out = bytearray(data)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            at = draw(st.integers(0, header - 1))
            out[at] ^= draw(st.integers(1, 255))
        return bytes(out)
    width = draw(st.sampled_from([4, 8]))
    at = draw(st.integers(0, header - width))
    value = draw(st.sampled_from(INTERESTING)) % (1 << (8 * width))
    out[at:at + width] = struct.pack("<I" if width == 4 else "<Q", value)
    return bytes(out)


OUTCOMES: dict[str, int] = {}


@given(st.data())
def test_damaged_gguf_loads_or_is_refused_clearly(tiny_gguf, data):
    raw, header = tiny_gguf
    outcome = load_or_refuse(data.draw(damage(raw, header)))
    OUTCOMES[outcome] = OUTCOMES.get(outcome, 0) + 1


def test_fuzzing_refused_and_loaded_some():
    """The fuzzing above reached both outcomes (its files were neither all broken nor all untouched)."""
    if not OUTCOMES:
        pytest.skip("the fuzzing test did not run in this session")
    assert OUTCOMES.get("refused", 0) > 0 and OUTCOMES.get("loaded", 0) > 0, OUTCOMES
    print(f"\nGGUF fuzzing outcomes: {OUTCOMES}")


# ---------------------------------------------------------------- regressions: crashes the fuzzing found


def _u32_of(data: bytes, key: str, value: int) -> bytes:
    """`data` with the uint32 value of `key` (after its 4-byte type) set to `value`."""
    at = data.index(key.encode()) + len(key) + 4
    return data[:at] + struct.pack("<I", value) + data[at + 4:]


def _renamed(data: bytes, key: str) -> bytes:
    return data.replace(key.encode(), key[:-1].encode() + b"Z", 1)


def _key_length(data: bytes, key: str, value: int) -> bytes:
    """`data` with the 8-byte length in front of the key `key` set to `value`."""
    at = data.index(key.encode()) - 8
    return data[:at] + struct.pack("<Q", value) + data[at + 8:]


def _u64_at(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + struct.pack("<Q", value) + data[at + 8:]


def _bad_token_utf8(data: bytes) -> bytes:
    at = data.index(b"\xc4\xa0", data.index(b"tokenizer.ggml.tokens"))
    return data[:at + 1] + b"A" + data[at + 2:]


def _merged_token_renamed(data: bytes) -> bytes:
    """The one-byte token 't' (half of the merge 'Ġ t') renamed: the merge names a token the vocabulary lacks."""
    at = data.index(struct.pack("<Q", 1) + b"t", data.index(b"tokenizer.ggml.tokens")) + 8
    return data[:at] + b"\x7f" + data[at + 1:]


REGRESSIONS = {
    # MemoryError: the architecture check read a key of the length the header gave (2**62 bytes)
    "huge key length": (lambda d: _key_length(d, "general.architecture", 1 << 62),
                        r"metadata key #1 of \d+ .*: its name is 4611686018427387904 bytes long, at most 65535 "
                        r"expected"),
    # the same for a string value's length, and a key count whose pairs cannot fit in the file
    "huge string length": (lambda d: _u64_at(d, d.index(b"general.architecture") + 24, (1 << 64) - 1),
                           r"metadata 'general.architecture': .* needs bytes .* but the file ends at byte \d+ \(the "
                           r"file looks corrupt"),
    "huge key count": (lambda d: _u64_at(d, 16, 1 << 63), r"the header: 9223372036854775808 metadata keys declared"),
    # TypeError: int(None) for a key whose name was damaged
    "missing block_count": (lambda d: _renamed(d, "llama.block_count"), "the metadata: no llama.block_count key"),
    "missing embedding_length": (lambda d: _renamed(d, "llama.embedding_length"),
                                 "the metadata: no llama.embedding_length key"),
    # RuntimeError in build_model: tensors of another size than the settings say (load_state_dict)
    "hidden size disagrees": (lambda d: _u32_of(d, "llama.embedding_length", 32), r"shape \(96, 64\), \(96, 32\) expected"),
    # RuntimeError in build_model: torch.cat of a 545 GB weight (a damaged head count and sizes)
    "huge hidden size": (lambda d: _u32_of(d, "llama.embedding_length", 0xFFFFFFFF), "expected from its settings"),
    "huge feed-forward size": (lambda d: _u32_of(d, "llama.feed_forward_length", 0x7FFFFFFF), "expected from its settings"),
    # a layer count sizing lists of names before any check (a hang, then MemoryError)
    "huge layer count": (lambda d: _u32_of(d, "llama.block_count", 0x7FFFFFFF), "declares 2147483647 layers"),
    # KeyError 'tokens', ValueError and UnicodeDecodeError from transformers' GGUF tokenizer reader
    "missing token list": (lambda d: _renamed(d, "tokenizer.ggml.tokens"), "cannot read the tokenizer"),
    "missing tokenizer model": (lambda d: _renamed(d, "tokenizer.ggml.model"), "cannot read the tokenizer"),
    "token not UTF-8": (_bad_token_utf8, "cannot read the tokenizer"),
    # Exception (the tokenizers library's own, not a subclass) from transformers' tokenizer builder
    "merge of a token not in the vocabulary": (_merged_token_renamed, r"cannot read the tokenizer from it \(Error "
                                               r"while initializing BPE: Token `t` out of vocabulary\)"),
}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_damage_the_fuzzing_found_is_refused_clearly(tiny_gguf, case):
    damage_of, message = REGRESSIONS[case]
    data = damage_of(tiny_gguf[0])
    assert len(data) == len(tiny_gguf[0]) and data != tiny_gguf[0]
    with tempfile.TemporaryDirectory() as tmp:
        path, cache = Path(tmp) / "damaged.gguf", Path(tmp) / "cache"
        path.write_bytes(data)
        with bounded(ALARM_S, ALLOC_CAP), pytest.raises(TriforceError) as refused:
            check_gguf_architecture(path)
            load_model(path, cache_dir=cache, progress=False)
        assert re.search(message, str(refused.value)), str(refused.value)
        assert_clear(str(refused.value), path)
        assert not cache.exists() or all(p.name.endswith(".lock") for p in cache.rglob("*"))
