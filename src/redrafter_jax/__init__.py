"""redrafter_jax: ReDrafter speculative decoding in JAX/Flax — train, decode, serve, export.

The curated public API; everything else is importable from its module. ReDrafter generation is
``redrafter_jax.decode.decode`` (not re-exported here: the name would hide the module).
"""

from redrafter_jax.config import (DecodeConfig, DrafterConfig, LlamaConfig, Preset, TrainConfig,
                                  load_preset)
from redrafter_jax.generate import generate
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.shipped import recommended_config, resolve_drafter
from redrafter_jax.tokenizer import encode, load_tokenizer, stop_token_ids
from redrafter_jax.weights.drafter_io import load_drafter, save_drafter
from redrafter_jax.weights.llama_weights import load_llama

__all__ = [
    "DecodeConfig", "Drafter", "DrafterConfig", "Llama", "LlamaConfig", "Preset", "TrainConfig",
    "encode", "generate", "load_drafter", "load_llama", "load_preset",
    "load_tokenizer", "recommended_config", "resolve_drafter", "save_drafter", "stop_token_ids",
]
__version__ = "0.1.0"
