"""Speculative decoding: model states, drafters, the verification level that composes, and methods."""
