"""The retrieval cache's chunk scores (caches/retrieval.py chunk_scores: q . each chunk's mean key), the compiled kernel
against PyTorch's operations, alternated in one process: the embedded model's 30 layers x 3 KV heads at 32K, chunks
of 8, as a retrieval build at 32K scores them.

    python benchmarks/chunk_scores_ab.py fp16                        # or bf16
    TRIFORCE_ISA=avx2 python benchmarks/chunk_scores_ab.py fp16      # the AVX2 build
"""
import sys, time, torch
from triforce import kernels
from triforce.caches import retrieval
torch.set_num_threads(2)
dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[1]]
B,H,N,D,c,L = 1,3,32000,64,8,30
buf=[torch.randn(1,H,N+200,D).to(dt) for _ in range(L)]
q=torch.randn(1,H,D)
n=(N-64)//c*c
ops = kernels.cpu()
def run(mod):
    with kernels.override(mod):
        t=time.perf_counter()
        for k in buf: retrieval.chunk_scores(k[:,:,:n], q, c)
        return (time.perf_counter()-t)*1e3
res={"kernel":[], "pytorch":[]}
for r in range(5):
    res["kernel"].append(run(ops)); res["pytorch"].append(run(None))
print(f"{ops.ISA} {sys.argv[1]} 30 layers x 3 KV heads, 32K keys, chunks of 8: " + ", ".join(f"{k} {sorted(v)[2]:.1f} ms (median of 5; {min(v):.1f}-{max(v):.1f})" for k,v in res.items()))
