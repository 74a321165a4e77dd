"""`triforce perplexity`: teacher-forced perplexity of a model on a text, by position band. Its options and run
live beside its code (bench/perplexity.py), which `python -m triforce.bench.perplexity` also runs."""
from __future__ import annotations

from ..bench.perplexity import add_arguments, run  # noqa: F401 (the command's options and run live with its code)

NAME = "perplexity"
HELP = "perplexity of a model on a text, by position band"
DESCRIPTION = ("Teacher-forced perplexity of the model on a text (BOS first where the model "
               "adds one, as llama.cpp's llama-perplexity does), overall and by position band; "
               "--rope-theta takes several bases to compare long-context profiles.")
