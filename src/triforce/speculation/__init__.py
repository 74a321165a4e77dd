"""Speculative decoding: stacks as data (stack.py), level kinds (kinds.py), the builder (builder.py), the rebuild
policy (rebuild.py), model states (state.py), drafters (drafters.py), the n-gram shortcut (shortcut.py), the adaptive
planner (planner.py) and the one acceptance rule (level.py)."""
