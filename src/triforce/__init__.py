"""triforce: fast, lossless long-context generation (TriForce hierarchical speculative decoding)."""
from .config import ModelConfig
from .errors import TriforceError
from .generate import GenerationResult, generate_ar, prefill
from .loading import LoadedModel, load_model
from .model import Transformer
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["ModelConfig", "TriforceError", "GenerationResult", "generate_ar", "prefill", "LoadedModel",
           "load_model", "Transformer", "SamplingParams", "__version__"]
