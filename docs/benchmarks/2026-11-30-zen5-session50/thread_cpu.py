"""CPU seconds per thread name of process PID over SECONDS (names from py-spy dump): python thread_cpu.py PID SECONDS"""
import os, sys, time, collections, subprocess, re
pid = sys.argv[1]; dur = float(sys.argv[2])
dump = subprocess.run(["py-spy", "dump", "--pid", pid], capture_output=True, text=True).stdout
names = {int(m.group(1)): m.group(2) for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]+)"', dump)}
def snap():
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = int(f[11]) + int(f[12])
        except OSError: pass
    return out
a = snap(); t = time.time(); time.sleep(dur); b = snap(); dt = time.time() - t
agg = collections.Counter()
for tid in b:
    agg[names.get(tid, "other(omp/native)")] += (b[tid] - a.get(tid, 0)) / os.sysconf("SC_CLK_TCK")
for k, d in agg.most_common(): print(f"{k:24s} {d:7.2f} s  ({d/dt:.0%} of a core)")
print(f"total {sum(agg.values()):.2f} s CPU over {dt:.1f} s wall")
