# The serving gate's timeline in a server process: on PYTHONPATH (ahead of the source), with GATE_LOG=FILE, each
# forward the gate runs appends "start seconds gap_before batch_size batched?" to FILE (every 100 forwards).
#   GATE_LOG=/tmp/gate.log PYTHONPATH=src:docs/benchmarks/2026-11-30-zen5-session50 python benchmarks/serve.py ...
#   python docs/benchmarks/2026-11-30-zen5-session50/gate_log_stats.py /tmp/gate.log
import os, time
if os.environ.get("GATE_LOG"):
    from triforce.execution import batching
    real = batching.ForwardGate._execute
    log = []
    state = {"last_end": None}
    def timed(self, chosen):
        t = time.perf_counter()
        real(self, chosen)
        e = time.perf_counter()
        log.append((t, e - t, state["last_end"] and t - state["last_end"], len(chosen), chosen[0].key is not None))
        state["last_end"] = e
        if len(log) % 100 == 0:
            with open(os.environ["GATE_LOG"], "a") as f:
                for r in log[-100:]:
                    f.write(" ".join(str(x) for x in r) + "\n")
    batching.ForwardGate._execute = timed
