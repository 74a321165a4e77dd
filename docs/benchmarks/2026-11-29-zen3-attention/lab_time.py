import sys, time, torch
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/tmp/lab/build_lab")
import importlib; ops = importlib.import_module(sys.argv[2] if len(sys.argv) > 2 else "lab")
torch.set_num_threads(int(__import__("os").environ.get("NT", "2")))
S = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
T = int(sys.argv[4]) if len(sys.argv) > 4 else 5
dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[sys.argv[5] if len(sys.argv) > 5 else "fp16"]
paths = [int(p) for p in (sys.argv[6] if len(sys.argv) > 6 else "1,5").split(",")]
L, H, D = int(__import__("os").environ.get("NL", "30")), 3, 64
R = 3 * T
ks = [torch.randn(H, S, D).to(dt) for _ in range(L)]
vs = [torch.randn(H, S, D).to(dt) for _ in range(L)]
q = torch.randn(H, R, D)
def step(p):
    for l in range(L):
        ops.decode_attention(q, ks[l], vs[l], T, T > 1, D ** -0.5, p)
res = {p: [] for p in paths}
for p in paths: step(p)
for it in range(int(sys.argv[7]) if len(sys.argv) > 7 else 7):
    for p in paths:
        t = time.process_time(); step(p); res[p].append(time.process_time() - t)
gflop = L * H * R * S * D * 4 / 1e9
for p in paths:
    ms = sorted(res[p])[len(res[p]) // 2] * 1e3
    print(f"S={S} T={T} R={R} {dt} path {p}: median {ms:.2f} ms  min {min(res[p])*1e3:.2f}  {gflop / ms * 1e3:.0f} GFLOP/s")
