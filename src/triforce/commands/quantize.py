"""Real quantized GGUF files from llama.cpp's own quantizer (`triforce quantize`), for benchmarks on the
formats people download (Q4_K_M above all) rather than on random blocks.

    triforce quantize --type Q4_K_M                   # the embedded model (its long-context profile)
    triforce bench --model "$(triforce quantize --type Q4_K_M --quiet)" --peers llama.cpp ...

The model's GGUF file is exported to F16 (every quantized tensor dequantized with gguf.quants; norms and
other 1-D tensors stay F32; the metadata copied), and llama.cpp's `llama_model_quantize` (through
llama-cpp-python: `./install.sh llama`) quantizes that to the type asked for, as its llama-quantize tool
would. The embedded model's export carries its long-context profile (RoPE base 4e5, 32K context) in the
metadata, so the new file is that model for us and for llama.cpp alike. Requantizing an already quantized
file compounds two roundings: the result is a model of its own, used the same way by every method and peer.
The output is written atomically and reused when asked for again (it is named after the source file, its
size and mtime, the type and the profile).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import memory, storage
from ..bench.peers import LlamaCppUnavailable, import_llama_cpp
from ..errors import TriforceError
from ..loading import DEFAULT_MAX_CONTEXT, DEFAULT_ROPE_THETA, default_model_path
from ..loading.gguf_check import check_gguf

NAME = "quantize"
HELP = "a real quantized GGUF (Q4_K_M, ...) of a model, by llama.cpp's quantizer"
DESCRIPTION = ("Export a GGUF model to F16 and quantize it with llama.cpp's own quantizer "
               "(needs the llama.cpp peer: ./install.sh llama), for benchmarks on the formats "
               "people download. The embedded model keeps its long-context profile (RoPE base "
               "4e5, 32K context) in the new file. Prints the new file's path; by default it is "
               "kept in the cache directory and reused.")

# llama.cpp's llama_ftype names for `--type` (LLAMA_FTYPE_MOSTLY_<name> in llama-cpp-python)
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M",
         "Q5_K_S", "Q5_K_M", "Q6_K")


def add_arguments(p) -> None:
    p.add_argument("--type", required=True, type=str.upper, choices=TYPES, metavar="TYPE",
                   help=f"llama.cpp quantization type: {', '.join(TYPES)}")
    p.add_argument("--model", metavar="PATH", help="a .gguf file (default: the embedded model)")
    p.add_argument("--output", metavar="FILE",
                   help="where to write the file (default: the cache directory, reused when asked for again)")
    p.add_argument("--rope-theta", type=float, metavar="BASE",
                   help="RoPE base written into the file (default: the file's; the embedded model's profile: 4e5)")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="context length written into the file (default: the file's; the embedded model: 32768)")
    p.add_argument("--threads", type=int, metavar="N", help="quantizer threads (default: one per core)")
    p.add_argument("--quiet", action="store_true", help="print only the output path")


def source_of(args) -> tuple[Path, float | None, int | None]:
    """(GGUF file, RoPE base to write or None, context to write or None) for the parsed options."""
    if args.model is None:
        return (default_model_path(), DEFAULT_ROPE_THETA if args.rope_theta is None else args.rope_theta,
                args.max_context or DEFAULT_MAX_CONTEXT)
    src = Path(args.model).expanduser()
    if not src.is_file() or src.suffix.lower() != ".gguf":
        raise TriforceError(f"triforce quantize reads a .gguf file; {src} is not one "
                            "(convert a Hugging Face directory with llama.cpp's convert_hf_to_gguf.py first)")
    return src, args.rope_theta, args.max_context


def default_output(src: Path, qtype: str, rope_theta: float | None, context: int | None) -> Path:
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{qtype}|{rope_theta}|{context}".encode())
    stem = src.name[:-len(".gguf")]
    return storage.cache_root() / "quantized" / f"{stem}-{key.hexdigest()[:12]}.{qtype}.gguf"


def export_f16(src: Path, dst: Path, rope_theta: float | None, context: int | None, log=print) -> None:
    """Write `src` (a GGUF file) to `dst` as F16 (1-D tensors F32), metadata copied, RoPE base and context
    length replaced where given."""
    import gguf  # start-up: gguf is 40 ms to import, only GGUF files need it

    reader = gguf.GGUFReader(src)
    f16_bytes, avail = sum(2 * int(t.n_elements) for t in reader.tensors), memory.available_bytes()
    if avail is not None and f16_bytes > 0.8 * avail:  # gguf's writer holds every tensor until it writes the file
        raise TriforceError(f"exporting {src.name} to F16 needs about {f16_bytes / 2**30:.1f} GiB of memory and "
                            f"{avail / 2**30:.1f} GiB are available: quantize it with llama.cpp's own "
                            "llama-quantize tool instead")
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    overrides = {}
    if rope_theta is not None:
        overrides[f"{arch}.rope.freq_base"] = (float(rope_theta), gguf.GGUFValueType.FLOAT32)
    if context is not None:
        overrides[f"{arch}.context_length"] = (int(context), gguf.GGUFValueType.UINT32)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") or field.name in overrides:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for name, (value, vtype) in overrides.items():
        writer.add_key_value(name, value, vtype)
    t0 = time.perf_counter()
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(values.astype(np.float32 if values.ndim == 1 else np.float16)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log(f"exported {src.name} to F16 ({len(reader.tensors)} tensors, {dst.stat().st_size / 1e6:.0f} MB) in "
        f"{time.perf_counter() - t0:.0f} s")


def quantize(src: Path, qtype: str, out: Path, rope_theta: float | None = None, context: int | None = None,
             threads: int | None = None, log=print) -> Path:
    """`src` exported to F16 and quantized to `qtype` by llama.cpp into `out` (atomically) -> out."""
    check_gguf(src)  # a damaged file: one line naming the part, before llama.cpp or gguf's reader sees it

    try:
        llama_cpp = import_llama_cpp()
    except LlamaCppUnavailable as e:
        raise TriforceError(f"triforce quantize uses llama.cpp's quantizer: {e}") from e
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}", None)
    if ftype is None:
        raise TriforceError(f"this llama-cpp-python has no {qtype} quantization")
    out = Path(out)
    storage.writable_dir(out.parent)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's line per tensor
    with storage.atomic_file(out) as tmp:
        f16 = storage.temporary_path(out.parent, ".f16.gguf")
        try:
            export_f16(src, f16, rope_theta, context, log)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = threads or 0  # 0: llama.cpp's default, one per core
            t0 = time.perf_counter()
            with _native_stderr() as said:
                rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params))
            if rc != 0 or not tmp.is_file():
                tail = "\n".join(said()[-10:])
                raise TriforceError(f"llama.cpp's quantizer failed on {src.name} (code {rc}); nothing was written"
                                    + (f". It said:\n{tail}" if tail else ""))
            fallbacks = [line for line in said() if "falling back to" in line]
            log(f"quantized to {qtype} by llama.cpp in {time.perf_counter() - t0:.0f} s: "
                f"{tmp.stat().st_size / 1e6:.0f} MB" + (
                    f"; {len(fallbacks)} tensors whose rows K-quant blocks do not divide took llama.cpp's fallback "
                    f"types ({', '.join(sorted({line.rsplit(' ', 1)[-1] for line in fallbacks}))})"
                    if fallbacks else ""))
        finally:
            f16.unlink(missing_ok=True)
    return out


@contextlib.contextmanager
def _native_stderr():
    """Collect what native code writes to file descriptor 2 in the block (llama.cpp's quantizer writes a line
    per tensor there) -> a function returning those lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        lines: list[str] = []
        try:
            yield lambda: lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            lines.extend(f.read().decode("utf-8", "replace").splitlines())


def run(args) -> int:
    src, rope_theta, context = source_of(args)
    out = Path(args.output).expanduser() if args.output else default_output(src, args.type, rope_theta, context)
    log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    if args.output or not out.is_file():
        quantize(src, args.type, out, rope_theta, context, args.threads, log)
    else:
        log(f"reusing {out.name} (made earlier from {src.name})")
    print(out)
    return 0
