"""The base model as it travels to a GPU machine: the GGUF's own quantized bytes, unpacked there.

A lent GPU machine reaches nothing outside it and its image has no ``gguf`` package, so the model
cannot be fetched there, and float32 weights (~540 MB for SmolLM2-135M) would take many calls.
``pack`` (here) writes the GGUF's tensors as they are stored (Q4_1 and Q8_0 blocks, F32 norms:
~92 MiB), with a manifest and the tokenizer saved by transformers; ``unpack`` (there) turns that
back into a Hugging Face folder (float32 safetensors, ``config.json``, tokenizer files) with the
NumPy dequantizer below, which ``load_llama`` and every bench read.

Layout of a pack folder: ``manifest.json`` (config, arch, each tensor's type, shape and byte
range), ``tensors.bin`` (every tensor's bytes, one after another), ``tokenizer/``.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

BLOCK = 32  # weights per Q4_1 / Q8_0 block
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
MANIFEST, TENSORS, TOKENIZER = "manifest.json", "tensors.bin", "tokenizer"


def dequantize(raw, kind: str, shape: tuple[int, ...]) -> np.ndarray:
  """Float32 weights of ``shape`` (PyTorch order) from GGUF bytes of type ``kind``.

  Q8_0 block: float16 scale d, 32 int8 q: w = d * q. Q4_1 block: float16 d, float16 m, 16 bytes
  of nibbles: weight j < 16 is the low nibble of byte j, weight 16 + j its high nibble,
  w = d * q + m (ggml's layouts).
  """
  raw = np.frombuffer(raw, np.uint8)
  if kind == "F32":
    return raw.view(np.float32).reshape(shape).copy()
  if kind == "F16":
    return raw.view(np.float16).astype(np.float32).reshape(shape)
  if kind not in _BLOCK_BYTES:
    raise ValueError(f"unsupported GGUF tensor type {kind} (supported: F32, F16, Q4_1, Q8_0)")
  blocks = raw.reshape(-1, _BLOCK_BYTES[kind])
  d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
  if kind == "Q8_0":
    w = blocks[:, 2:].copy().view(np.int8).astype(np.float32) * d
  else:
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    w = q * d + m
  return w.reshape(shape)


def pack(model: str | pathlib.Path, out: pathlib.Path, *,
         tokenizer: pathlib.Path | None = None) -> pathlib.Path:
  """Write the pack of a GGUF model (a known name or a ``.gguf`` path) into ``out``.

  ``tokenizer``: a folder of tokenizer files to ship; default: the model's own, built by
  transformers from the GGUF here (the GPU image cannot: it has no ``gguf``)."""
  from redrafter_jax.weights.gguf_file import GGUF_TO_HF, read_index
  from redrafter_jax.weights.llama_weights import resolve_source
  from redrafter_jax.weights.naming import WeightsError, unused

  path = resolve_source(str(model))
  if path.suffix != ".gguf":
    raise WeightsError(f"{path}: the lease carries GGUF models (their quantized bytes fit the "
                       "runner's per-call limit); got a non-GGUF source")
  index = read_index(path)
  data = np.memmap(path, dtype=np.uint8, mode="r")
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  tensors, offset = [], 0
  with open(out / TENSORS, "wb") as f:
    for t in index.tensors:
      if unused(t.name):
        continue
      raw = index.raw(data, t).tobytes()
      tensors.append(dict(gguf=t.name, hf=GGUF_TO_HF.to_ours(t.name)[0], type=t.type,
                          shape=list(t.shape), offset=offset, nbytes=len(raw)))
      f.write(raw)
      offset += len(raw)
  if tokenizer is None:
    from redrafter_jax.weights.tokenizer import load_tokenizer

    load_tokenizer(path).save_pretrained(str(out / TOKENIZER))
  else:
    shutil.copytree(tokenizer, out / TOKENIZER)
  (out / MANIFEST).write_text(json.dumps(dict(
      config=index.config.to_hf(), arch=index.arch, tensors=tensors),
      indent=1))
  return out


def unpack(src: pathlib.Path, out: pathlib.Path) -> dict[str, np.ndarray]:
  """Write the HF folder of a pack; returns its tensors."""
  from safetensors.numpy import save_file

  from redrafter_jax.config import LlamaConfig
  from redrafter_jax.weights.gguf_file import unpermute_qk

  if not (src / MANIFEST).is_file() or not (src / TENSORS).is_file():
    raise FileNotFoundError(f"{src}: not a model pack (want {MANIFEST} and {TENSORS})")
  manifest = json.loads((src / MANIFEST).read_text())
  cfg = LlamaConfig.from_hf(manifest["config"])
  data = (src / TENSORS).read_bytes()
  want = sum(t["nbytes"] for t in manifest["tensors"])
  if len(data) != want:
    raise ValueError(f"{src / TENSORS}: {len(data)} bytes, the manifest lists {want}")
  tensors = {}
  for t in manifest["tensors"]:
    w = dequantize(data[t["offset"]:t["offset"] + t["nbytes"]], t["type"], tuple(t["shape"]))
    if manifest["arch"] == "llama" and (".attn_q." in t["gguf"] or ".attn_k." in t["gguf"]):
      w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t["gguf"] else cfg.num_kv_heads)
    tensors[t["hf"]] = np.ascontiguousarray(w)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(manifest["config"], indent=1))
  if (src / TOKENIZER).is_dir():
    for f in (src / TOKENIZER).iterdir():
      shutil.copy(f, out / f.name)
  return tensors
