"""The compiled CPU decode-attention kernel against PyTorch's attention (skipped where it cannot be built)."""
from __future__ import annotations

import pytest
import torch

from triforce import kernels, model
from triforce.kv.base import CAUSAL


@pytest.fixture(scope="module")
def kern():
    k = kernels.decode_attention()
    if k is None:
        pytest.skip("the decode-attention kernel is not available on this machine")
    return k


# S = 1500 is not a multiple of the kernel's 256-key blocks; with S = 1282 and T = 4 the last block
# holds only new tokens 2 and 3, so it is fully masked for tokens 0 and 1.
@pytest.mark.parametrize("T, mask_kind, S", [(1, None, 1500), (2, "causal", 1500), (4, "causal", 1500),
                                             (4, "causal", 1282), (2, "bool", 1500), (1, "bool", 1500)])
def test_kernel_matches_sdpa(kern, T, mask_kind, S, monkeypatch):
    torch.manual_seed(0)
    Hq, Hkv, D, cap = 6, 2, 64, 1600
    q = torch.randn(1, Hq, T, D)
    k_store, v_store = torch.randn(1, Hkv, cap, D), torch.randn(1, Hkv, cap, D)
    k, v = k_store[:, :, :S], v_store[:, :, :S]  # strided like a cache slice
    if mask_kind == "causal":
        mask = CAUSAL
    elif mask_kind == "bool":
        mask = torch.rand(T, S) < 0.7
        mask[:, 0] = True
    else:
        mask = None
    assert Hq // Hkv * T <= model.KERNEL_MAX_ROWS and S >= model.KERNEL_MIN_KEYS
    counting = _Counting(kern)
    monkeypatch.setitem(kernels._state, "decode_attention", counting)
    got = model.attention(q, k, v, mask)
    # the kernel really ran (bool masks, from the StreamingLLM cache, stay on PyTorch's path)
    assert counting.calls == (0 if mask_kind == "bool" else 1)
    monkeypatch.setitem(kernels._state, "decode_attention", None)  # PyTorch's path
    want = model.attention(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Counting:
    def __init__(self, kern):
        self.kern, self.calls = kern, 0

    def decode_attention(self, *a):
        self.calls += 1
        return self.kern.decode_attention(*a)
