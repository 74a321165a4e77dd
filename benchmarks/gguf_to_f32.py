"""Write an F32 copy of a GGUF file: every tensor dequantized with gguf-py, every metadata key copied
(general.file_type set to ALL_F32). llama.cpp then computes with the same weights triforce's fp32 path and
transformers dequantize to, without its quantized dot products (which round activations to 8 bits):
a check that separates "a different model" from "llama.cpp's quantized arithmetic".

    python benchmarks/gguf_to_f32.py /tmp/g3/gemma-3-270m-q4_k_m.gguf /tmp/g3/gemma-3-270m-f32.gguf
"""
from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        # gguf-py's shapes are GGML's (innermost first); dequantize gives the numpy (outermost first) array
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.add_tensor(t.name, np.ascontiguousarray(w), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
