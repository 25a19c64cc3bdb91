"""redrafter_jax: ReDrafter speculative decoding in JAX/Flax — train, decode, serve, export.

The curated public API; everything else is importable from its module (the packages follow the
data: ``models`` -> ``weights`` -> ``inference`` -> ``training`` / ``serving`` -> ``bench`` /
``commands``; docs/design.md, "Layout of the source").
"""

from redrafter_jax.config import (DecodeConfig, DrafterConfig, LlamaConfig, Preset, TrainConfig,
                                  load_preset)
from redrafter_jax.errors import UserError
from redrafter_jax.hostmem import keep_freed_memory
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import DecodeResult, ReDrafter, decode
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.weights.drafter_io import load_drafter, save_drafter
from redrafter_jax.weights.llama_weights import load_llama
from redrafter_jax.weights.param_dtype import weights_dtype
from redrafter_jax.weights.shipped import recommended_config, resolve_drafter
from redrafter_jax.weights.tokenizer import encode, load_tokenizer, stop_token_ids

__all__ = [
    "DecodeConfig", "DecodeResult", "Drafter", "DrafterConfig", "Llama", "LlamaConfig", "Preset",
    "ReDrafter", "TrainConfig", "UserError", "decode", "encode", "generate", "load_drafter",
    "keep_freed_memory", "load_llama", "load_preset", "load_tokenizer", "recommended_config",
    "resolve_drafter", "save_drafter", "stop_token_ids", "weights_dtype",
]
__version__ = "0.1.0"
