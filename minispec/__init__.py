"""minispec: exact speculative decoding for Llama-family models, written to be read.

Start with speculative.py; the README's reading order says what comes next."""

from .io.checkpoint import load_checkpoint
from .io.tokenizer import Tokenizer
from .llm import LLM
from .model.config import ModelConfig
from .model.llama import Transformer
from .model.metadata import BatchMetadata
from .model.attention import AttentionBackend
from .fast.int8 import quantize_model
from .outputs import RequestOutput, StreamEvent
from .runtime.kv_cache import KVPoolExhausted
from .sampling import SamplingParams

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
