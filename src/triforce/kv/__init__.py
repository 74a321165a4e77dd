"""KV caches: full, StreamingLLM (sink + window) and TriForce retrieval, behind one interface."""
from .base import KVCache
from .full import FullCache
from .retrieval import RetrievalCache
from .streaming import StreamingCache

__all__ = ["KVCache", "FullCache", "RetrievalCache", "StreamingCache"]
