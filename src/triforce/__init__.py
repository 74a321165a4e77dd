"""triforce: fast, lossless long-context generation (TriForce hierarchical speculative decoding)."""
from .config import ModelConfig
from .errors import TriforceError
from .generate import GenerationResult, StreamChunk, generate, generate_ar, generate_stream
from .loading import LoadedModel, load_model
from .model import Transformer
from .sampling import SamplingParams
from .speculation.settings import SpecConfig
from .speculation.stack import LevelSpec, StackSpec, method_stack
from .speculation.state import PrefilledPrompt, prefill

__version__ = "0.1.0"
__all__ = ["ModelConfig", "TriforceError", "GenerationResult", "StreamChunk", "generate", "generate_ar",
           "generate_stream", "prefill", "LoadedModel", "load_model", "Transformer", "SamplingParams", "SpecConfig",
           "LevelSpec", "StackSpec", "method_stack", "PrefilledPrompt", "__version__"]
