"""Every loader and exporter: base models (``llama_weights``: GGUF, HF; ``gguf_file``: a GGUF's
config and tensors; ``base_model``: model specs incl. random test models; ``fetch``: the model
cache), tokenizers (``tokenizer``), drafters (``drafter_io``: reference / MLX / TensorRT-LLM,
``shipped``: the drafter in checkpoints/) and ``mlx_runtime`` (the exported drafter run with MLX
ops, which checks the MLX export)."""
