"""KV caches behind one interface: full, sliding-window (Gemma 3), StreamingLLM (sink + window) and TriForce
retrieval."""
from .base import SLIDING_WINDOW_UNSUPPORTED, KVCache
from .full import FullCache
from .retrieval import RetrievalCache
from .sliding import SlidingWindowCache
from .streaming import StreamingCache

__all__ = ["KVCache", "FullCache", "RetrievalCache", "SlidingWindowCache", "StreamingCache",
           "SLIDING_WINDOW_UNSUPPORTED"]
