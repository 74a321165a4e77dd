"""KV caches behind one interface: full, sliding-window (Gemma 3: a ring for the sliding-window layers, any
of the others for the global layers), StreamingLLM (sink + window), TriForce retrieval, H2O (heavy hitters), and quantized (int8 /
the 4-bit planes of kv4)."""
from .base import BufferPool, KVCache
from .full import FullCache
from .h2o import H2OCache
from .new import new_cache, new_plane_view, new_window_cache
from .quantized import QuantizedCache
from .retrieval import RetrievalCache
from .sliding import SlidingWindowCache
from .streaming import StreamingCache

__all__ = ["BufferPool", "KVCache", "FullCache", "H2OCache", "QuantizedCache", "RetrievalCache", "SlidingWindowCache", "StreamingCache",
           "new_cache",
           "new_plane_view", "new_window_cache"]
