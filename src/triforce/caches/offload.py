"""The full KV cache in pinned host memory, streamed to the GPU layer by layer (TriForce's offloading).

With the whole cache off the GPU, a 7B model's 128K-token cache (64 GiB in fp16 for Llama-2's 32 KV
heads) leaves the card to the weights and the small retrieval cache; each verification then moves
the cache over PCIe once, which is what the paper's offloading setting prices: the drafting levels,
resident on the GPU, make many tokens per expensive verification.

Per forward, layer l's past keys/values are copied host -> GPU into one of two staging buffers on a
side stream while layer l - 1 computes (the copy of layer l + 1 is queued as soon as layer l's is
used), the new tokens' K/V go to the staging buffer and back to the host (device -> pinned host,
asynchronous), and attention reads the staging buffer. The host copy is the cache: rollback stays
O(1) (an integer), and `layer_kv` (a retrieval build) returns GPU copies of a layer.
"""
from __future__ import annotations

import torch

from .base import QueryRecorder, SlotKV
from .full import FullCache


class OffloadedCache(FullCache):
    """Host k / v: per layer a pinned [capacity, B, Hkv, D] tensor (position-major, so a layer's first n
    positions are one contiguous block: a single DMA at PCIe speed, where a [.., Hkv, capacity, D]
    slice would be strided and go through a CPU copy; one allocation per layer, since a single pinned
    block of tens of GiB can be refused where the same memory in pieces is not); staging on the GPU
    [B, Hkv, capacity, D] as attention reads it."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *,
                 batch: int = 1, dtype: torch.dtype = torch.float16, device: torch.device | str = "cuda",
                 record_queries: bool = False):
        self.device = torch.device(device)
        host = (capacity, batch, n_kv_heads, head_dim)
        self._registered: list[int] = []  # host pointers registered with CUDA, unregistered in __del__
        self.k = [self._pinned(host, dtype) for _ in range(n_layers)]
        self.v = [self._pinned(host, dtype) for _ in range(n_layers)]
        stage = (batch, n_kv_heads, capacity, head_dim)
        self.stage_k = [torch.empty(stage, dtype=dtype, device=self.device) for _ in range(2)]
        self.stage_v = [torch.empty(stage, dtype=dtype, device=self.device) for _ in range(2)]
        self.landing = [torch.empty(host, dtype=dtype, device=self.device) for _ in range(2)]  # as on the host
        self.copy_stream = torch.cuda.Stream(self.device)
        self.loaded = [torch.cuda.Event() for _ in range(2)]
        self.n_layers, self.capacity, self.length = n_layers, capacity, 0
        self.recorder = QueryRecorder(n_layers) if record_queries else None
        self._block = None
        self._n_new = 0
        self.bytes_moved = 0  # host -> GPU, for the benchmarks

    @property
    def slot_layout(self) -> None:
        """None: its buffers live on the host, so its forwards run eagerly, through update()."""
        return None

    def _pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed page-locked host tensor of exactly its bytes. PyTorch's pinned allocator
        (`pin_memory=True`) rounds every block up to a power of two: a 1.08 GB layer of Llama-2-7B at 128K
        took 2 GiB, and that cache's 64 layers asked a 125 GiB host for 137 GB and were killed (measured on
        an H200 machine: 4 such layers used 8.9 GB pinned, 4.6 GB registered). So the pages are ordinary
        memory, touched, then registered with CUDA (cudaHostRegister); pinned as before if that fails."""
        t = torch.zeros(shape, dtype=dtype)
        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) != cudart.cudaError.success:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        self._registered.append(t.data_ptr())
        return t

    def __del__(self):
        # Unregister before the tensors (and their pages) go: CUDA requires it of registered memory.
        try:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
        except Exception:  # interpreter shutdown: the driver releases everything anyway
            pass
        self._registered = []

    def _prefetch(self, layer: int) -> None:
        """Queue the copy of `layer`'s past K/V (positions < length) into its staging buffers, on the side
        stream, after everything queued so far on the compute stream (the buffers' last reader)."""
        if layer >= self.n_layers:
            return
        n, b = self.length, layer % 2
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for host, stage in ((self.k, self.stage_k[b]), (self.v, self.stage_v[b])):
                land = self.landing[b][:n]
                land.copy_(host[layer][:n], non_blocking=True)  # one contiguous block over PCIe
                stage[:, :, :n].copy_(land.permute(1, 2, 0, 3))  # to attention's layout, at HBM speed
            self.loaded[b].record(self.copy_stream)
        self.bytes_moved += 2 * self.k[layer][:n].numel() * self.k[layer].element_size()

    def prepare(self, n_new, block=None):
        super().prepare(n_new, block)
        self._prefetch(0)

    def update(self, layer, q, k, v):
        start, end, b = self.length, self.length + self._n_new, layer % 2
        torch.cuda.current_stream(self.device).wait_event(self.loaded[b])
        dk, dv = self.stage_k[b], self.stage_v[b]
        dk[:, :, start:end] = k
        dv[:, :, start:end] = v
        self.k[layer][start:end].copy_(k.permute(2, 0, 1, 3), non_blocking=True)
        self.v[layer][start:end].copy_(v.permute(2, 0, 1, 3), non_blocking=True)
        if self.recorder is not None:
            self.recorder.record(layer, q)
        self._prefetch(layer + 1)  # its buffers' last reader (layer - 1's attention) is queued already
        return SlotKV(dk[:, :, :end], dv[:, :, :end], self._block)

    def layer_kv(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, n, D] of positions 0 .. n - 1 of `layer`, copied to the GPU."""
        torch.cuda.current_stream(self.device).synchronize()  # the host copy holds every written token
        return tuple(h[layer][:n].to(self.device).permute(1, 2, 0, 3) for h in (self.k, self.v))

    def keep(self, start: int, rows: list[int]) -> None:
        if rows == list(range(len(rows))):
            return self.rollback(start + len(rows))
        torch.cuda.current_stream(self.device).synchronize()  # rows are moved on the host copy
        idx = torch.tensor(rows)
        for layer in self.k + self.v:
            layer[start:start + len(rows)] = layer[start + idx]
        self._kept(start, start, idx.to(self.device))
        self.length = start + len(rows)
