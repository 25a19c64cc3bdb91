"""Checkpoint formats: base-model loaders (GGUF, HF) and drafter import/export."""
