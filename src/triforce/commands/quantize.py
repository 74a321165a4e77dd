"""`triforce quantize`: a real quantized GGUF of a model, made by llama.cpp's quantizer. Its options and run
live beside its code (bench/quantize.py)."""
from __future__ import annotations

from ..bench.quantize import add_arguments, run  # noqa: F401 (the command's options and run live with its code)

NAME = "quantize"
HELP = "a real quantized GGUF (Q4_K_M, ...) of a model, by llama.cpp's quantizer"
DESCRIPTION = ("Export a GGUF model to F16 and quantize it with llama.cpp's own quantizer "
               "(needs the llama.cpp peer: ./install.sh llama), for benchmarks on the formats "
               "people download. The embedded model keeps its long-context profile (RoPE base "
               "4e5, 32K context) in the new file. Prints the new file's path; by default it is "
               "kept in the cache directory and reused.")
