"""How a model runs on its device, apart from what it computes (model.py): attention over what a KV cache hands a
layer, linear layers over every weight format, the fused CPU decode of every layer, and the Execution object that
chooses among them once per model, and the model runner that executes its forwards, single or batched (runner.py;
a serving batch's, through the server's gate: batching.py)."""
from .attention import KERNEL_HEAD_DIMS, KERNEL_MAX_ROWS, attention, bf16_attention, slot_attention
from .backend import Execution
from .linear import KERNEL_CHUNKS_MAX_ROWS, PANEL_MAX_ROWS, Linear, QuantEmbedding, QuantLinear

__all__ = ["Execution", "KERNEL_CHUNKS_MAX_ROWS", "KERNEL_HEAD_DIMS", "KERNEL_MAX_ROWS", "Linear", "PANEL_MAX_ROWS",
           "QuantEmbedding", "QuantLinear", "attention", "bf16_attention", "slot_attention"]
