"""Median forward and gap before it of the batched forwards of 8 in a gate log (sitecustomize.py here)."""
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
b = [(float(r[1]), float(r[2]) if r[2] != "None" else None, int(r[3])) for r in rows if r[4] == "True"]
full = [x for x in b if x[2] == 8]
print(f"  batched forwards of 8: {len(full)}; forward median {statistics.median(x[0] for x in full) * 1e3:.2f} ms; gap before median {statistics.median(x[1] for x in full if x[1] is not None and x[1] < 0.05) * 1e3:.2f} ms")
