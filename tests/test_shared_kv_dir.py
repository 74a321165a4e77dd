"""One --kv-cache-dir shared by several servers (replicas) on one host: concurrent writers of the
same blocks, readers while others write, eviction by one while another reads. Each PrefixCache
here stands for one process (its own flock file descriptions, its own writer thread); a few run in
real child processes too. Whatever the interleaving: no exception, no block that differs from what
was written, and a fresh server afterwards loads the folder without refusing a file."""
from __future__ import annotations

import logging
import multiprocessing
import random
import threading

import pytest
import torch

from conftest import hf_tiny, ours_from_hf
from triforce.caches import FullCache
from triforce.serving.prefix_blocks import block_keys
from triforce.serving.prefix_cache import PrefixCache

C = 8  # tokens per block


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(hf_tiny("llama", seed=3))


def kv_of(model, tokens: list[int]):
    """Deterministic K/V and last-token queries for `tokens` (what a prefill forward would give:
    a function of the token prefix only), shaped as a FullCache of batch 1."""
    cfg, n = model.cfg, len(tokens)
    cache = FullCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, dtype=model.kv_dtype)
    cache.length = n
    k, v = cache.k, cache.v
    queries = {}
    for i, key in enumerate(block_keys(tokens, C)):
        g = torch.Generator().manual_seed(int(key[:12], 16))
        k[:, 0, :, i * C:(i + 1) * C] = torch.randn(k[:, 0, :, :C].shape, generator=g).to(k.dtype)
        v[:, 0, :, i * C:(i + 1) * C] = torch.randn(k[:, 0, :, :C].shape, generator=g).to(k.dtype)
        queries[i] = torch.randn(cfg.n_layers, cfg.n_heads, cfg.head_dim, generator=g)
    return cache, queries


def prompt(doc: int, blocks: int) -> list[int]:
    rng = random.Random(doc)
    return [rng.randrange(90) for _ in range(blocks * C)]


def check_blocks(model, cache: PrefixCache, tokens: list[int]) -> int:
    """Look `tokens` up; every block found must hold what kv_of computes. -> blocks found."""
    found = cache.lookup(tokens)
    want, queries = kv_of(model, tokens)
    for b in found:
        i = b.index
        assert torch.equal(b.k, want.k[:, 0, :, i * C:(i + 1) * C]) and torch.equal(b.v, want.v[:, 0, :, i * C:(i + 1) * C])
        assert torch.equal(b.q_last, queries[i])
    return len(found)


def insert(model, cache: PrefixCache, tokens: list[int]) -> None:
    kv, queries = kv_of(model, tokens)
    cache.insert(tokens, kv, queries)


def fresh_load(model, folder, caplog) -> PrefixCache:
    caplog.clear()
    cache = PrefixCache(model, C, 1 << 30, folder)
    assert not [m for m in caplog.messages if "refusing" in m], caplog.messages
    return cache


def test_a_block_written_by_one_server_is_read_by_another(model, tmp_path):
    a, b = PrefixCache(model, C, 1 << 30, tmp_path), PrefixCache(model, C, 1 << 30, tmp_path)
    doc = prompt(0, 6)
    insert(model, a, doc)
    a.close()  # (its writes are done)
    assert check_blocks(model, b, doc + [1, 2, 3]) == 6  # from the shared folder: b never computed them
    assert b.stats()["blocks"] == 6
    b.close()


def test_concurrent_writers_of_the_same_blocks(model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="triforce.serve")
    caches = [PrefixCache(model, C, 1 << 30, tmp_path) for _ in range(3)]
    docs = [prompt(d, 5) for d in range(4)]

    def write(cache, seed):
        order = docs * 3
        random.Random(seed).shuffle(order)
        for doc in order:
            insert(model, cache, doc)

    threads = [threading.Thread(target=write, args=(c, i)) for i, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in caches:
        c.close()
    folder = caches[0].dir
    assert not list(folder.glob(".tmp-*"))
    after = fresh_load(model, tmp_path, caplog)
    assert after.stats()["blocks"] == 4 * 5
    for doc in docs:
        assert check_blocks(model, after, doc) == 5
    after.close()


def test_readers_during_writes_and_eviction_while_another_reads(model, tmp_path, caplog):
    """A writer with room for about 3 documents inserts 12 in turn (evicting, so removing files) while
    two readers look every document up again and again: each block a reader gets is exact."""
    caplog.set_level(logging.INFO, logger="triforce.serve")
    probe = PrefixCache(model, C, 1 << 30)  # (in memory: one block's size)
    insert(model, probe, prompt(99, 1))
    block_bytes = next(iter(probe.blocks.values())).nbytes
    writer = PrefixCache(model, C, 12 * block_bytes, tmp_path)  # room for 3 documents of 4 blocks
    readers = [PrefixCache(model, C, 8 * block_bytes, tmp_path) for _ in range(2)]
    docs = [prompt(d, 4) for d in range(12)]
    stop, found, errors = threading.Event(), [0, 0], []

    def read(i):
        rng = random.Random(i)
        try:
            while not stop.is_set():
                found[i] += check_blocks(model, readers[i], rng.choice(docs))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            raise

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for doc in docs:
        insert(model, writer, doc)
        writer._writer.submit(lambda: None).result()  # its files are on disk before the next
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert sum(found) > 0  # the readers did read blocks the writer wrote
    for c in [writer, *readers]:
        c.close()
    after = fresh_load(model, tmp_path, caplog)
    assert 0 < after.stats()["blocks"] <= 12  # the readers wrote nothing: only the writer's blocks
    after.close()


def _child_writes(folder: str, seed: int) -> None:
    model = ours_from_hf(hf_tiny("llama", seed=3))
    cache = PrefixCache(model, C, 1 << 30, folder)
    order = [prompt(d, 5) for d in range(4)] * 2
    random.Random(seed).shuffle(order)
    for doc in order:
        insert(model, cache, doc)
    cache.close()


@pytest.mark.slow  # two spawned writer processes, each importing torch
def test_concurrent_writer_processes(model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="triforce.serve")
    ctx = multiprocessing.get_context("spawn")
    children = [ctx.Process(target=_child_writes, args=(str(tmp_path), seed)) for seed in range(2)]
    for p in children:
        p.start()
    for p in children:
        p.join(120)
        assert p.exitcode == 0
    after = fresh_load(model, tmp_path, caplog)
    assert after.stats()["blocks"] == 4 * 5
    for d in range(4):
        assert check_blocks(model, after, prompt(d, 5)) == 5
    after.close()
