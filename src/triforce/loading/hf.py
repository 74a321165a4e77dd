"""Load a local Hugging Face checkpoint directory: config.json + *.safetensors (sharded or not)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ModelConfig
from ..errors import TriforceError


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise TriforceError(f"{directory} has no config.json: pass a Hugging Face model directory or a .gguf file")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TriforceError(f"cannot read {path}: {e}") from e


def read_hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise TriforceError(
            f"{directory} has no *.safetensors weights (PyTorch .bin checkpoints are not supported: "
            f"convert them with safetensors first)"
        )
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # corrupt or truncated file
            raise TriforceError(f"cannot read weights {f}: {e}") from e
    return sd


def load_hf_checkpoint(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    hf = read_hf_config(directory)
    cfg = ModelConfig.from_hf(hf)
    return cfg, read_hf_state_dict(directory), hf
