"""redrafter_jax: ReDrafter speculative decoding in JAX/Flax — train, decode, serve, export.

The curated public API; everything else is importable from its module.
"""

from redrafter_jax.config import (DecodeConfig, DrafterConfig, LlamaConfig, Preset, TrainConfig,
                                  load_preset)
from redrafter_jax.generate import generate
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.weights.llama_weights import load_llama

__all__ = [
    "DecodeConfig", "Drafter", "DrafterConfig", "Llama", "LlamaConfig", "Preset", "TrainConfig",
    "generate", "load_llama", "load_preset",
]
__version__ = "0.1.0"
