#!/usr/bin/env bash
# Fetch llama.cpp's HF -> GGUF converter (convert_hf_to_gguf.py with its conversion/ package and its own
# gguf-py/) from the llama-cpp-python sdist on PyPI, for tests/test_real_converter.py, and install the one
# module it imports that triforce does not need (sentencepiece).
#
#   tests/fetch_llama_converter.sh            # llama-cpp-python 0.3.36 (the version install.sh builds)
#   tests/fetch_llama_converter.sh 0.3.36
#
# Unpacks into ${TRIFORCE_CACHE_DIR:-~/.cache/triforce}/llama-converter/llama_cpp_python-VERSION/vendor/llama.cpp/,
# where the tests look (or point $TRIFORCE_LLAMA_CONVERTER at any convert_hf_to_gguf.py). Then:
#   python -m pytest tests/test_real_converter.py      # the tests
#   python tests/test_real_converter.py                # the measurements as a Markdown table
set -euo pipefail
VERSION="${1:-0.3.36}"
ROOT="${TRIFORCE_CACHE_DIR:-$HOME/.cache/triforce}/llama-converter"
NAME="llama_cpp_python-$VERSION"
mkdir -p "$ROOT"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/llama-sdist.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# The sdist (about 80 MB) only; nothing is built or installed.
python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: --no-build-isolation \
    "llama-cpp-python==$VERSION" -d "$tmp" 2>/dev/null \
  || python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$tmp"
sdist="$(ls "$tmp"/llama_cpp_python-"$VERSION".tar.gz)"
src="$NAME/vendor/llama.cpp"
rm -rf "${ROOT:?}/$NAME"
tar -xzf "$sdist" -C "$ROOT" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE"
python -m pip install --disable-pip-version-check -q sentencepiece
echo "$ROOT/$src/convert_hf_to_gguf.py"
