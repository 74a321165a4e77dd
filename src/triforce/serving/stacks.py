"""A request's own speculation stack: the `stack` and `gammas` extension fields (the web page's method and stack
choice), checked when the request arrives so that a stack that cannot run here is a 400 naming what is wrong, not an
error after the stream has begun.

    {"prompt": "...", "stack": "triforce"}                                   a named method (`triforce generate --method`)
    {"prompt": "...", "stack": "ngram,retrieval:1024,full", "gammas": "3,4"}  levels, as --levels / --gammas

Every stack gives the target's exact output, so a request's stack changes its speed, never its tokens. The server's
speculation settings (--budget, --gamma, --draft, --no-adapt...) apply to a request's stack as to its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..drafthead.loading import head_for
from ..errors import TriforceError
from ..speculation.stack import METHODS, StackSpec, method_stack
from .protocol import BadRequest


@dataclass(frozen=True)
class RequestStack:
    spec: StackSpec
    name: str  # the method's name, or the levels (as `triforce generate` names a run)


class StackChooser:
    """Parses and checks a request's `stack` / `gammas` against this server: the grammar, budgets within the model's
    context, a draft model for a `draft` level, a draft head for a `head` level."""

    def __init__(self, model, config, draft_model=None):
        self.model, self.config, self.draft_model = model, config, draft_model

    def __call__(self, stack, gammas) -> RequestStack | None:
        """-> the request's stack, or None for the server's own (neither field given); BadRequest otherwise."""
        if stack is None and gammas is None:
            return None
        if gammas is not None and stack is None:
            raise BadRequest("'gammas' needs 'stack' (a method or levels such as ngram,retrieval:1024,full)", "gammas")
        if not isinstance(stack, str) or not stack.strip():
            raise BadRequest(f"'stack' must be a method ({', '.join(METHODS)}) or levels such as "
                             f"ngram,retrieval:1024,full", "stack")
        if gammas is not None and not (isinstance(gammas, str) or isinstance(gammas, int) and not isinstance(gammas, bool)
                                       or isinstance(gammas, list) and all(isinstance(g, int) for g in gammas)):
            raise BadRequest("'gammas' must be integers: \"3,4\", 4 or [3, 4]", "gammas")
        c, text = self.config, stack.strip()
        try:
            if text in METHODS:
                spec = method_stack(text, c.gamma, c.gamma_draft, c.draft, adaptive=c.adapt and gammas is None)
                if gammas is not None:  # (fixed gammas fix the stack, as --gammas does on the command line)
                    spec = StackSpec.parse(spec.levels_text, gammas, c.gamma, spec.tree or None)
                name = text
            else:
                spec, name = StackSpec.parse(text, gammas, c.gamma), text
            spec.check_budgets(self.model.cfg.max_context, {"retrieval": c.budget, "h2o": c.budget,
                                                            "streaming": c.streaming_budget}, c.sink + 1)
        except TriforceError as e:
            raise BadRequest(f"'stack': {e}".replace("--levels", "'stack'").replace("--gammas", "'gammas'"),
                             "stack") from None
        kinds = {lvl.kind for lvl in spec.levels}
        if "draft" in kinds and self.draft_model is None:
            raise BadRequest(f"'stack': {spec.levels_text} has a 'draft' level, and this server has no draft model "
                             f"(start it with --draft PATH)", "stack")
        if "head" in kinds:
            try:
                head_for(self.model, c.head)  # (loaded once per model: the request's stack finds it ready)
            except TriforceError as e:
                raise BadRequest(f"'stack': {e}", "stack") from None
        return RequestStack(spec, name)
