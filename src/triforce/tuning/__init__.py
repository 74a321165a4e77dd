"""`triforce tune` and what it leaves behind: this machine's tuned speculation flags, which `generate` and `bench`
read at run time (flags.py), the tuning itself (tune.py), and the timing helpers it shares with the
benchmarks (measure.py)."""
