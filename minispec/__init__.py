"""minispec: exact speculative decoding for Llama-family models, written to be read."""

from .attention import AttentionBackend, BatchMetadata
from .config import ModelConfig
from .kv_cache import KVPoolExhausted
from .llm import LLM, RequestOutput, StreamEvent
from .loader import load_checkpoint
from .model import Transformer
from .quant import quantize_model
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "StreamEvent",
    "ModelConfig",
    "Transformer",
    "Tokenizer",
    "AttentionBackend",
    "BatchMetadata",
    "KVPoolExhausted",
    "load_checkpoint",
    "quantize_model",
]
