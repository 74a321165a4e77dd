"""KV caches behind one interface: full, sliding-window (Gemma 3: a ring for the sliding-window layers, any
of the others for the global layers), StreamingLLM (sink + window) and TriForce retrieval."""
from .base import KVCache
from .full import FullCache
from .retrieval import RetrievalCache
from .sliding import SlidingWindowCache
from .streaming import StreamingCache

__all__ = ["KVCache", "FullCache", "RetrievalCache", "SlidingWindowCache", "StreamingCache"]
