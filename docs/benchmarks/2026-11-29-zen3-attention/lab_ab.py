"""python lab_ab.py MOD[,MOD2...] S T THREADS [dtype] [reps]: lab builds of kernels/attention.cpp (each in /tmp/lab/MOD/, built by torch.utils.cpp_extension with the AVX2 flags and a binding of decode_attention only), alternated in one process (distinct module names: distinct builds); median CPU time (1 thread) or wall time of 30 layers x 3 KV heads; whether each output equals the first build's bit for bit.
The binding: lab_bind.cpp (copy it and ops.h, simd.h to /tmp/lab/)."""
import sys, time, os
import torch
from torch.utils.cpp_extension import load
mods = sys.argv[1].split(",")
S, T, th = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[5] if len(sys.argv) > 5 else "fp16"]
reps = int(sys.argv[6]) if len(sys.argv) > 6 else 7
torch.set_num_threads(th)
M = {}
for n in mods:
    src = f"/tmp/lab/{n}/attention.cpp"
    M[n] = load(n, [src, "/tmp/lab/lab_bind.cpp"], extra_cflags=["-O3", "-mtune=native", "-fopenmp", "-march=x86-64-v3", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-I/tmp/lab"], extra_ldflags=["-fopenmp"], build_directory=f"/tmp/lab/build_{n}")
L, H, D = 30, 3, 64
R = 3 * T
torch.manual_seed(0)
ks = [torch.randn(H, S, D).to(dtype) for _ in range(L)]
vs = [torch.randn(H, S, D).to(dtype) for _ in range(L)]
q = torch.randn(H, R, D)
clock = time.process_time if th == 1 else time.perf_counter
outs = {}
def step(m):
    o = None
    for l in range(L):
        o = m.decode_attention(q, ks[l], vs[l], T, T > 1, D ** -0.5, 0)
    return o
for n in mods:
    outs[n] = step(M[n]); step(M[n])
times = {n: [] for n in mods}
for _ in range(reps):
    for n in mods:
        t = clock(); step(M[n]); times[n].append(clock() - t)
gflop = L * H * R * S * D * 4 / 1e9
for n in mods:
    ms = sorted(times[n])[len(times[n]) // 2] * 1e3
    same = torch.equal(outs[n], outs[mods[0]])
    print(f"{n:12s} S={S} T={T} th={th} {dtype}: {ms:8.2f} ms  {gflop / ms * 1e3:6.1f} GFLOP/s  bits==first: {same}")
