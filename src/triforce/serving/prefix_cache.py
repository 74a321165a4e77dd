"""The prefix KV cache: the target's full-cache keys and values of prompt prefixes, in hashed token
blocks (as vLLM's automatic prefix caching), LRU under a byte budget, optionally mirrored on disk.

Blocks. A block holds `block_size` consecutive prompt tokens at positions [i*C, (i+1)*C) (C = the
block size, which is the prefill chunk) and their K/V, [n_layers, n_kv_heads, C, head_dim] each in
the model's KV dtype, plus the post-RoPE queries of its last token ([n_layers, n_heads, head_dim]:
a retrieval level builds its cache from the query of the last prompt token). Its key is the chain
hash of its tokens and its parent's key, so a key names the whole prefix [0, (i+1)*C): the longest
cached prefix of a prompt is found by hashing its blocks in order until one is missing.

Why blocks of exactly the prefill chunk: a block is stored only when its tokens were one whole
prefill forward (positions [i*C, (i+1)*C) fed together), and a prompt reuses blocks only up to a
multiple of C, prefilling the rest from there in chunks of C. So the full cache of a request that
hit the cache holds bit for bit what a fresh prefill of its prompt would: the output is exactly
`triforce generate`'s. (Reusing a prefix of any length, or generated tokens, whose K/V came from
forwards of other shapes, would change the last bits and could flip a greedy choice.)

Eviction: least recently used *leaf* blocks first (a block no cached block extends), so every
cached block's prefix stays cached; a chain is touched root to leaf, the leaf newest.

Persistence (`directory`): DIR/<settings digest>/ holds one safetensors file per block and
manifest.json, keyed by the settings (`settings_key`: a fingerprint of the weights, the KV dtype,
RoPE, the block size, the compute backend). Files are written atomically (storage.atomic_write),
the manifest after the files it lists. At start-up every file is checked (listed, size, SHA-256,
its own metadata naming these settings, tokens hashing to its key, tensor shapes and dtypes): a
file that fails is refused with a log line, removed, and never loaded. Directories of other
settings (another model, KV dtype, RoPE base...) are left alone, with a log line.

Sharing (several servers or replicas on one host, one DIR): every change to the folder (block files,
the manifest, removals, the start-up check) happens under an flock on DIR/<digest>/.lock, and the
manifest is merged, not overwritten: each process adds the blocks it wrote and removes the files of
its own blocks (written or loaded at start-up) that it evicts; a block another process wrote already
is adopted, not written again, and its file is that process's to remove. A lookup that misses in
memory reads the next blocks from the folder (the same checks as at start-up, without the lock:
files appear and go by atomic renames and unlinks, so a reader sees a whole file or none; one that
fails a check is a miss, left for the start-up check). So one replica reuses the prefixes another
prefilled, and an eviction only ever turns another's disk hit into a miss. The folder holds at most
the budgets of the servers sharing it together.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .. import storage
from ..model import Transformer
from .prefix_blocks import FORMAT, Block, chain_hash, key_digest, leading, settings_key

log = logging.getLogger("triforce.serve")

MANIFEST = "manifest.json"
LOCK_WAIT_SECONDS = 120.0  # the longest another server may hold the shared folder's lock (writing blocks)


class PrefixCache:
    """Cached prompt-prefix blocks of one model and settings; see the module docstring.

    Used by the engine's single worker thread; `stats()` may be read from any thread (a lock); the
    files are written by a writer thread of its own, in the order the blocks came and went."""

    def __init__(self, model: Transformer, block_size: int, budget_bytes: int, directory: str | os.PathLike | None = None):
        self.model, self.block_size, self.budget = model, block_size, budget_bytes
        self.key = settings_key(model, block_size)
        self.digest = key_digest(self.key)
        self.blocks: dict[str, Block] = {}
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = 0
        self._clock = 0
        self._lock = threading.Lock()
        self._exit = ExitStack()
        self.dir: Path | None = None
        self._writer: ThreadPoolExecutor | None = None
        if directory is not None and budget_bytes > 0:
            self.dir = self._open_directory(Path(directory).expanduser())
            if self.dir is not None:
                self._load()
                # one writer thread, in order: the next request does not wait for the files (724 MB at 32K)
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="triforce-kv-writer")

    # ---- lookup and insertion ---------------------------------------------------------------

    def lookup(self, tokens: list[int]) -> list[Block]:
        """The cached blocks of the longest cached prefix of `tokens` (whole blocks only), root first;
        touches them (most recently used). Counts a hit (at least one block) or a miss."""
        C, out, parent, shared = self.block_size, [], None, None
        with self._lock:
            for i in range(len(tokens) // C):
                part = tuple(tokens[i * C:(i + 1) * C])
                key = chain_hash(parent, part)
                b = self.blocks.get(key)
                if b is None and self.dir is not None:  # another process may have written it
                    shared = self._manifest_entries(quiet=True) if shared is None else shared
                    b = self._adopt(key, shared.get(key))
                if b is None or b.tokens != part:  # (a hash collision would show here)
                    break
                out.append(b)
                parent = b.key
            self._touch(out)
            if shared:
                self._evict_and_forget()
            if out:
                self.hits += 1
                self.hit_tokens += len(out) * C
            else:
                self.misses += 1
        return out

    def insert(self, tokens: list[int], cache, block_queries: dict[int, torch.Tensor]) -> int:
        """Store the whole blocks of `tokens` whose K/V `cache` (a FullCache, batch 1) holds at
        positions [0, len(tokens)) from one prefill forward each: blocks already cached, or computed
        with their last-token queries in `block_queries` (block index -> [n_layers, n_heads, D]).
        Stops at the first block it has neither for. Evicts down to the budget, writes the new
        blocks to disk. -> the number of new blocks."""
        if self.budget <= 0:
            return 0
        C, parent, chain, new = self.block_size, None, [], []
        with self._lock:
            for i in range(min(len(tokens), cache.length) // C):
                part = tuple(tokens[i * C:(i + 1) * C])
                key = chain_hash(parent, part)
                b = self.blocks.get(key)
                if b is None:
                    if i not in block_queries:
                        break
                    b = Block(key, parent, i, part, *cache.read_positions(i * C, (i + 1) * C),
                              block_queries[i].clone())
                    if b.nbytes > self.budget:
                        break
                    self.blocks[key] = b
                    self.bytes += b.nbytes
                    if parent is not None:
                        self.blocks[parent].children += 1
                    new.append(b)
                chain.append(b)
                parent = key
            self._touch(chain)
            evicted = [b for b in self._evict() if b.owned]  # a file another server wrote stays
            new = [b for b in new if b.key in self.blocks]
        if self._writer is not None and self.dir is not None and (new or evicted):
            self._writer.submit(self._persist, new, evicted)
        return len(new)

    def held(self, keys: list[str]) -> int:
        """How many of `keys` (a prompt's block keys, root first) are cached in memory, from the first on
        (any thread; counts no hit and touches nothing)."""
        with self._lock:
            return leading(keys, self.blocks)

    def keys(self) -> list[str]:
        """The keys of the cached blocks (any thread)."""
        with self._lock:
            return list(self.blocks)

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self.blocks), "bytes": self.bytes, "budget_bytes": self.budget,
                    "block_size": self.block_size, "hits": self.hits, "misses": self.misses,
                    "hit_tokens": self.hit_tokens, "directory": str(self.dir) if self.dir else None}

    def close(self) -> None:
        """Finish the pending writes, release the directory lock (the files stay)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self._exit.close()

    def _touch(self, chain: list[Block]) -> None:
        for b in chain:  # root first: the leaf ends up newest, so leaves go before their parents
            self._clock += 1
            b.last_used = self._clock

    def _evict(self) -> list[Block]:
        """Drop least recently used leaves until the cache fits its budget; -> the dropped blocks."""
        out = []
        while self.bytes > self.budget and self.blocks:
            victim = min((b for b in self.blocks.values() if b.children == 0), key=lambda b: b.last_used)
            self._drop(victim)
            out.append(victim)
        return out

    def _drop(self, b: Block) -> None:
        del self.blocks[b.key]
        self.bytes -= b.nbytes
        if b.parent is not None and b.parent in self.blocks:
            self.blocks[b.parent].children -= 1

    def _adopt(self, key: str, entry) -> Block | None:
        """The block `key` read from the shared folder into memory (caller holds self._lock), or None:
        not there, or it fails a check (another process may be replacing or removing it)."""
        if entry is None:
            return None
        try:
            b = self._read_block(key, entry)
        except _Refused:
            return None
        if (b.parent is not None and b.parent not in self.blocks) or b.nbytes > self.budget:
            return None
        b.last_used, b.owned = 0, False
        self.blocks[key] = b
        self.bytes += b.nbytes
        if b.parent is not None:
            self.blocks[b.parent].children += 1
        return b

    def _evict_and_forget(self) -> None:
        """After adopting blocks from disk: back under the budget, the evicted files removed."""
        evicted = [b for b in self._evict() if b.owned]
        if evicted and self._writer is not None and self.dir is not None:
            self._writer.submit(self._persist, [], evicted)

    # ---- the on-disk copy -------------------------------------------------------------------

    def _open_directory(self, root: Path) -> Path | None:
        """Our settings' folder under `root`, locked for this process (None: persistence off, logged)."""
        folder = root / self.digest
        try:
            storage.writable_dir(folder)
        except storage.CacheUnwritable as e:
            log.warning("%s: not persisting the prefix cache", e)
            return None
        storage.remove_stale_temporaries(folder)
        for other in sorted(p for p in root.iterdir() if p.is_dir() and p != folder):
            self._refuse_foreign(other)
        return folder

    def _folder_lock(self):
        """The flock every change to the folder holds (other servers sharing it wait, up to a bound)."""
        return storage.exclusive(self.dir / ".lock", "writing the shared KV cache", LOCK_WAIT_SECONDS, log=log.info)

    def _refuse_foreign(self, folder: Path) -> None:
        try:
            theirs = json.loads((folder / MANIFEST).read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            return  # not one of ours
        if not isinstance(theirs, dict):
            return
        diff = [k for k in sorted(set(self.key) | set(theirs)) if self.key.get(k) != theirs.get(k)]
        log.warning("refusing the KV cache in %s: made with other settings (%s differ%s); not loaded",
                    folder, ", ".join(diff) or "the digest", "" if len(diff) != 1 else "s")

    def _manifest_entries(self, quiet: bool = False) -> dict:
        path = self.dir / MANIFEST
        if not path.exists():
            return {}
        say = (lambda *a: None) if quiet else log.warning
        try:
            manifest = json.loads(path.read_text())
            if manifest.get("key") != self.key:
                say("refusing the KV cache manifest %s: made with other settings; starting empty", path)
                return {}
            entries = manifest["blocks"]
            if not isinstance(entries, dict):
                raise TypeError("blocks is not an object")
            return entries
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            say("refusing the KV cache manifest %s: unreadable (%s: %s); starting empty", path, type(e).__name__, e)
            return {}

    def _load(self) -> None:
        """Load the checked blocks of our folder, parents first, while they fit the budget (under the
        folder's lock: no other process writes meanwhile)."""
        with self._folder_lock():
            self._load_locked()

    def _load_locked(self) -> None:
        t0 = time.perf_counter()
        entries = self._manifest_entries()
        refused = 0
        listed = {str(e.get("file")) for e in entries.values() if isinstance(e, dict)}
        for p in sorted(self.dir.glob("*.safetensors")):
            if p.name not in listed:
                log.warning("refusing the KV cache file %s: not in the manifest (an interrupted write?); removed", p)
                p.unlink(missing_ok=True)
        order = sorted(entries.items(), key=lambda kv: (kv[1].get("index", 0) if isinstance(kv[1], dict) else 0,
                                                        -(kv[1].get("last_used", 0) if isinstance(kv[1], dict) else 0)))
        skipped, over, gone = 0, 0, set()
        for key, entry in order:
            try:
                b = self._read_block(key, entry)
            except _Refused as e:
                log.warning("refusing the KV cache file %s: %s; removed, not loaded", self.dir / str(entry.get("file")
                            if isinstance(entry, dict) else key), e)
                (self.dir / f"{key}.safetensors").unlink(missing_ok=True)
                refused += 1
                gone.add(key)
                continue
            if b.parent in gone or (b.parent is not None and b.parent not in entries):
                skipped += 1  # its prefix was refused or is missing: unreachable
                gone.add(key)
                continue
            if b.parent is not None and b.parent not in self.blocks:
                over += 1  # its prefix did not fit: left on disk (another server may use it)
                continue
            if self.bytes + b.nbytes > self.budget:
                over += 1
                continue
            self.blocks[key] = b
            self.bytes += b.nbytes
            if b.parent is not None:
                self.blocks[b.parent].children += 1
        for b in sorted(self.blocks.values(), key=lambda b: (b.index, b.last_used)):
            self._clock += 1
            b.last_used = self._clock
        if gone:
            self._merge_manifest({}, gone)
            for key in gone:
                (self.dir / f"{key}.safetensors").unlink(missing_ok=True)
        if self.blocks or refused:
            log.info("prefix cache: loaded %d blocks (%.1f MB, %d tokens of prefixes) from %s in %.1f s%s",
                     len(self.blocks), self.bytes / 1e6, len(self.blocks) * self.block_size, self.dir,
                     time.perf_counter() - t0, f"; {refused} refused" if refused else "")
        if skipped:
            log.info("prefix cache: %d blocks on disk not loaded and removed (their prefix was refused)", skipped)
        if over:
            log.info("prefix cache: %d blocks on disk not loaded (over --prefix-cache-bytes); left there", over)

    def _read_block(self, key: str, entry) -> Block:
        if not isinstance(entry, dict) or entry.get("file") != f"{key}.safetensors":
            raise _Refused("its manifest entry is malformed")
        path = self.dir / entry["file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            raise _Refused(f"unreadable ({e.strerror or e})") from None
        if len(data) != entry.get("bytes"):
            raise _Refused(f"truncated or changed: {len(data)} bytes, the manifest says {entry.get('bytes')}")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise _Refused("corrupt: its SHA-256 differs from the manifest's")
        try:
            tensors = load(data)
            meta = _metadata(data)
        except (SafetensorError, ValueError, RuntimeError, OSError) as e:
            raise _Refused(f"not a readable safetensors file ({e})") from None
        if meta.get("triforce_kv_cache") != self.digest or meta.get("key") != json.dumps(self.key, sort_keys=True):
            raise _Refused("made with another model or settings (its metadata names other settings)")
        cfg, C = self.model.cfg, self.block_size
        kv = self.model.kv_dtype
        want = {"k": ((cfg.n_layers, cfg.n_kv_heads, C, cfg.head_dim), kv),
                "v": ((cfg.n_layers, cfg.n_kv_heads, C, cfg.head_dim), kv),
                "q_last": ((cfg.n_layers, cfg.n_heads, cfg.head_dim), None), "tokens": ((C,), torch.int64)}
        for name, (shape, dtype) in want.items():
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
                raise _Refused(f"tensor {name} is missing or has the wrong shape or dtype")
        tokens = tuple(tensors["tokens"].tolist())
        parent = meta.get("parent") or None
        if chain_hash(parent, tokens) != key or parent != entry.get("parent"):
            raise _Refused("its tokens do not hash to its name")
        return Block(key, parent, int(entry.get("index", 0)), tokens, tensors["k"], tensors["v"], tensors["q_last"],
                     last_used=int(entry.get("last_used", 0)), file=(len(data), entry["sha256"]))

    def _persist(self, new: list[Block], evicted: list[Block]) -> None:
        """Block files first, then the manifest listing them, then the evicted files go. A failure
        (full disk...) turns persistence off with one log line: serving goes on from memory."""
        try:
            with self._folder_lock():
                on_disk = self._manifest_entries(quiet=True)
                for b in new:
                    theirs = on_disk.get(b.key)
                    if isinstance(theirs, dict) and (self.dir / f"{b.key}.safetensors").exists():
                        b.file = (theirs.get("bytes"), theirs.get("sha256"))  # another process wrote it: adopt
                        b.owned = False
                        continue
                    meta = {"triforce_kv_cache": self.digest, "key": json.dumps(self.key, sort_keys=True),
                            "parent": b.parent or ""}
                    data = save({"k": b.k.contiguous(), "v": b.v.contiguous(), "q_last": b.q_last.contiguous(),
                                 "tokens": torch.tensor(b.tokens, dtype=torch.int64)}, metadata=meta)
                    storage.atomic_write(self.dir / f"{b.key}.safetensors", data)
                    b.file = (len(data), hashlib.sha256(data).hexdigest())
                gone = {b.key for b in evicted}
                self._merge_manifest({b.key: b for b in new if b.file is not None and b.key not in gone}, gone)
                for key in gone:
                    (self.dir / f"{key}.safetensors").unlink(missing_ok=True)
        except storage.LockTimeout as e:
            log.warning("the shared KV cache in %s stays locked (%s): persistence off for this run", self.dir, e)
            self.dir = None
        except OSError as e:
            log.warning("cannot write the KV cache to %s (%s): persistence off for this run", self.dir, e.strerror or e)
            self.dir = None
        except Exception:  # noqa: BLE001 - on the writer thread: nobody else would see it
            log.exception("writing the KV cache to %s failed: persistence off for this run", self.dir)
            self.dir = None

    def _merge_manifest(self, add: dict[str, Block], remove: set[str]) -> None:
        """The manifest on disk with `add` (this process's written blocks) listed and `remove` gone;
        the entries of other processes sharing the folder stay (the caller holds the folder's lock)."""
        entries = {k: e for k, e in self._manifest_entries(quiet=True).items() if k not in remove}
        with self._lock:
            for b in add.values():
                entries[b.key] = {"file": f"{b.key}.safetensors", "bytes": b.file[0], "sha256": b.file[1],
                                  "parent": b.parent, "index": b.index, "last_used": b.last_used}
        storage.atomic_write(self.dir / MANIFEST, json.dumps({"format": FORMAT, "key": self.key, "blocks": entries},
                                                             indent=1, sort_keys=True))


class _Refused(Exception):
    """Why a block file is not loaded."""


def _metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file's header (8-byte little-endian length, JSON)."""
    n = int.from_bytes(data[:8], "little")
    if n <= 0 or n > len(data) - 8:
        raise ValueError("bad header length")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}
