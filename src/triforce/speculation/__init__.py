"""Speculative decoding: stacks as data (stack.py), level kinds (kinds.py), the builder and rebuild
policy (decoder.py), model states (state.py), drafters (drafters.py) and the one acceptance rule (level.py)."""
