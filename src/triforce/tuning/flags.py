"""This machine's tuned flags: `triforce tune` records them, `generate` and `bench` use them by default.

One JSON file in the cache (cache_root()/tuned.json, or $TRIFORCE_TUNED_FILE: the tests keep theirs
apart). An entry holds what a tune run chose, keyed by what its measurements depend on:

    identity   machine (CPU model, kernel ISA, threads; or the GPU), model (its source, file size and
               modification time, weights and dtype), the target's KV dtype, and the code (a hash of
               triforce's own source files: any change to the package makes older entries stale)
    kind       "chain" (--budget, --gamma, --gamma-draft of `--method triforce`) or "tree" (--tree of
               `--method sequoia`)
    where      the context length and temperature it was tuned at

A lookup takes, among the entries of this identity and kind, those of the same temperature class
(greedy, or sampled), the nearest temperature, then the nearest context length within a factor of 2;
none there: the defaults. Entries of this model and KV dtype from another machine or an older code are
ignored with a message saying so (their measurements describe something else).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..kernels.build import cpu_model
from ..speculation.stack import StackSpec, method_stack
from ..storage import atomic_write, cache_root, exclusive, writable_dir

FILE = "tuned.json"
FILE_ENV = "TRIFORCE_TUNED_FILE"
ENTRY_KINDS = ("chain", "tree")  # what a tuned entry sets: a chain's flags, or a tree
CONTEXT_FACTOR = 2.0  # an entry serves contexts within this factor of the one it was tuned at

_code_hash: str | None = None


def code_version() -> str:
    """A short hash of the package's source files (.py, .cpp, .h): tuned costs hold for this code only."""
    global _code_hash
    if _code_hash is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _code_hash = h.hexdigest()[:12]
    return _code_hash


def machine_id(model) -> str:
    """What the costs were measured on: the GPU's name, or the CPU's model, kernel ISA and thread count."""
    if model.device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(model.device)}"
    ops = model.backend.ops
    isa = getattr(ops, "ISA", "pytorch") if ops is not None else "pytorch"
    cpu = cpu_model() or platform.processor() or platform.machine()
    return f"{cpu}, {isa} kernels, {torch.get_num_threads()} threads"


def model_id(loaded) -> str:
    """The model as loaded: its source, the file's size and modification time, weights and dtype."""
    path = loaded.gguf_path or loaded.directory
    try:
        st = Path(path).stat()
        stamp = f"{st.st_size} bytes, modified {int(st.st_mtime)}"
    except OSError:
        stamp = "?"
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    return f"{loaded.source} ({path}, {stamp}), weights {loaded.weights}, {dtype}"


def identity(loaded) -> dict:
    return {"machine": machine_id(loaded.model), "model": model_id(loaded),
            "kv_dtype": str(loaded.model.kv_dtype).removeprefix("torch."), "code": code_version()}


def _path(loaded) -> Path:
    env = os.environ.get(FILE_ENV)
    return Path(env).expanduser() if env else cache_root(loaded.cache_dir) / FILE


def _read(path: Path) -> list[dict]:
    try:
        entries = json.loads(path.read_text(encoding="utf-8")).get("entries", [])
        return [e for e in entries if isinstance(e, dict) and "identity" in e and "kind" in e]
    except (OSError, ValueError, AttributeError):
        return []  # none yet, or unreadable: a tune run writes a fresh one


def record(loaded, kind: str, context_length: int, temperature: float, flags: dict, measured: dict) -> Path:
    """Save what a tune run chose (replacing an entry of the same identity, kind, context and
    temperature); -> the file. Written atomically under a lock, so concurrent tune runs keep both."""
    assert kind in ENTRY_KINDS
    path = _path(loaded)
    writable_dir(path.parent)
    entry = {"identity": identity(loaded), "kind": kind, "context_length": int(context_length),
             "temperature": float(temperature), "flags": flags, "measured": measured,
             "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    with exclusive(path.with_name(path.name + ".lock"), "writing the tuned flags", 60):
        entries = [e for e in _read(path)
                   if not (e["identity"] == entry["identity"] and e["kind"] == kind
                           and e.get("context_length") == entry["context_length"]
                           and e.get("temperature") == entry["temperature"])]
        atomic_write(path, json.dumps({"entries": entries + [entry]}, indent=1))
    return path


def lookup(loaded, kind: str, context_length: int, temperature: float, log=None) -> dict | None:
    """The entry to use for a run of `kind` at this context and temperature, or None (see the module's
    docstring). `log` gets one line when entries of this model exist but are another machine's or stale."""
    entries = [e for e in _read(_path(loaded)) if e["kind"] == kind]
    if not entries:
        return None
    me = identity(loaded)
    same_model = [e for e in entries if e["identity"].get("model") == me["model"]
                  and e["identity"].get("kv_dtype") == me["kv_dtype"]]
    mine = [e for e in same_model if e["identity"] == me]
    if not mine:
        if same_model and log is not None:
            other = same_model[-1]["identity"]
            why = (f"measured on {other.get('machine')}, and this run is on {me['machine']}"
                   if other.get("machine") != me["machine"] else "from another version of triforce")
            log(f"triforce: ignoring the tuned flags in {_path(loaded)}: they are {why}; "
                f"run `triforce tune` here to tune for this one")
        return None
    greedy = temperature <= 0
    fits = [e for e in mine if (e["temperature"] <= 0) == greedy
            and max(e["context_length"], context_length) <= CONTEXT_FACTOR * min(e["context_length"], context_length)]
    if not fits:
        return None
    return min(fits, key=lambda e: (abs(e["temperature"] - temperature),
                                    abs(math.log(e["context_length"] / max(context_length, 1)))))


def flags_text(entry: dict) -> str:
    """The flags of an entry as a user would type them."""
    f = entry["flags"]
    return (f"--budget {f['budget']} --gamma {f['gamma']} --gamma-draft {f['gamma_draft']}" if entry["kind"] == "chain"
            else f"--tree {f['tree']}")


def describe(entry: dict) -> str:
    """The flags of an entry, and where they were tuned."""
    return (f"{flags_text(entry)} (tuned at context {entry['context_length']}, T={entry['temperature']:g}, "
            f"{entry['written']})")


def tuned_run(loaded, method: str, config, context_length: int, temperature: float, log=None):
    """-> (stack, config, entry) running the named `method` with this machine's tuned flags, or None (no entry
    applies, or the method has nothing tuned): `triforce` takes a chain entry's budget and gammas, `sequoia` a
    tree entry's tree."""
    kind = {"triforce": "chain", "sequoia": "tree"}.get(method)
    entry = lookup(loaded, kind, context_length, temperature, log) if kind else None
    if entry is None:
        return None
    f = entry["flags"]
    if kind == "chain":
        config = replace(config, budget=int(f["budget"]), gamma=int(f["gamma"]), gamma_draft=int(f["gamma_draft"]))
        config.validate()
        return (method_stack(method, config.gamma, config.gamma_draft, config.draft, adaptive=config.adapt), config,
                entry)
    named = method_stack(method, config.gamma, config.gamma_draft, config.draft)
    return StackSpec.parse(named.levels_text, named.gammas, config.gamma, str(f["tree"])), config, entry


def tuned_allowed(args, method: str) -> bool:
    """Whether a run of the named `method` may take this machine's tuned flags: not with
    --no-tuned or --levels / --gammas, nor where the user set what is tuned (triforce: --budget, --gamma,
    --gamma-draft; sequoia: --tree)."""
    if getattr(args, "no_tuned", False) or getattr(args, "levels", None) is not None or getattr(args, "gammas", None):
        return False
    if method == "triforce":
        return args.gamma is None and args.gamma_draft is None and args.budget is None
    return method == "sequoia" and getattr(args, "tree", None) is None
