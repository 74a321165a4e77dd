"""Finding and loading draft heads: a directory `train-drafter` wrote (head.py's format), a published EAGLE-1 / EAGLE-3
checkpoint (eagle.py), or the head shipped for the embedded model; each loaded once per model."""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

from safetensors.torch import load_file

from ..errors import TriforceError
from ..model import Transformer
from .eagle import load_eagle
from .head import CONFIG_FILE, FORMAT, WEIGHTS_FILE, DraftHead, HeadConfig, target_fingerprint


def load_head(directory: str | os.PathLike, model: Transformer) -> DraftHead:
    """A head saved by DraftHead.save (or converted from a published layout: drafthead.eagle) for `model`;
    TriforceError naming the problem when it is missing, damaged or made for another model."""
    d = Path(directory)
    if (d / CONFIG_FILE).is_file() and not (d / WEIGHTS_FILE).is_file():
        return load_eagle(d, model)  # a published EAGLE checkpoint (its own config.json and weight names)
    if not (d / CONFIG_FILE).is_file():
        raise TriforceError(f"no draft head in {d}: expected {CONFIG_FILE} and {WEIGHTS_FILE} (made by "
                            f"`triforce train-drafter`) or an EAGLE checkpoint directory")
    try:
        raw = json.loads((d / CONFIG_FILE).read_text())
        if raw.get("format") != FORMAT:
            return load_eagle(d, model)
        cfg = HeadConfig(**raw)
        sd = load_file(str(d / WEIGHTS_FILE))
    except TriforceError:
        raise
    except Exception as e:
        raise TriforceError(f"cannot read the draft head in {d}: {e}") from e
    check_compatible(cfg, model, d)
    head = DraftHead(cfg, model.cfg)
    try:
        head.load_state_dict(sd)
    except RuntimeError as e:
        raise TriforceError(f"the draft head in {d} is damaged or of another shape: {e}") from e
    return head.eval()


def check_compatible(cfg: HeadConfig, model: Transformer, where) -> None:
    c = model.cfg
    if cfg.hidden_size != c.hidden_size or cfg.vocab_size != c.vocab_size:
        raise TriforceError(f"the draft head in {where} was made for a model with hidden size {cfg.hidden_size} and "
                            f"vocabulary {cfg.vocab_size}, not this {c.arch} model ({c.hidden_size}, {c.vocab_size}): "
                            f"train one for it with `triforce train-drafter --model ...`")
    if cfg.target != target_fingerprint(model):
        raise TriforceError(f"the draft head in {where} was trained for another model ({cfg.target}; this one is "
                            f"{target_fingerprint(model)}): train one for this model with "
                            f"`triforce train-drafter --model ...`")


SHIPPED = Path(__file__).parent / "heads"  # heads trained for the embedded model (one directory each)
EMBEDDED_HEAD = SHIPPED / "smollm2-135m-instruct"
_LOADED: weakref.WeakKeyDictionary[Transformer, dict[str, DraftHead]] = weakref.WeakKeyDictionary()


def head_for(model: Transformer, path: str | os.PathLike | None) -> DraftHead:
    """The draft head at `path`, or ("" / None) the one shipped for the embedded model; loaded once per model."""
    loaded = _LOADED.setdefault(model, {})
    head = loaded.get(str(path or ""))
    if head is None:
        if path:
            head = load_head(path, model)
        elif (EMBEDDED_HEAD / CONFIG_FILE).is_file() and target_fingerprint(model) == json.loads(
                (EMBEDDED_HEAD / CONFIG_FILE).read_text()).get("target"):
            head = load_head(EMBEDDED_HEAD, model)
        else:
            raise TriforceError(f"a 'head' level needs a draft head for this {model.cfg.arch} model: train one with "
                                f"`triforce train-drafter --model PATH --out DIR` and pass --head DIR (a head ships "
                                f"only for the embedded SmolLM2-135M-Instruct)")
        loaded[str(path or "")] = head
    return head
