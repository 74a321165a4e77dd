"""Trained draft heads (EAGLE's design): the head (head.py), its drafter in a stack (drafter.py), training
on the CPU (train.py) and published EAGLE checkpoints (eagle.py)."""
from .head import DraftHead, HeadConfig
from .loading import load_head

__all__ = ["DraftHead", "HeadConfig", "load_head"]
