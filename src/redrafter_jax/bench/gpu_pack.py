"""``python -m redrafter_jax.bench gpu_pack``: carry the real model to a lent GPU machine, run there.

A lent GPU machine reaches nothing outside it and takes at most 64 MiB per call (the tracked tree
included), and its image has no ``gguf`` package. So the model travels as the GGUF's own
quantized bytes (Q4_1 and Q8_0 blocks, F32 norms: ~92 MiB for SmolLM2-135M) cut into parts, and
is dequantized on the machine by NumPy code of this module, not by ``gguf``:

  ``pack``    (here)   GGUF -> ``.gpu_pack/``: ``manifest.json`` (config, tensors, parts), the
                       tokenizer files, and the tensors' bytes as one stream cut into
                       ``part-<i>.bin`` of at most ``--part-mib`` MiB each;
  ``plan``    (here)   prints the device calls: one per part (``carry`` that part), the last
                       one running ``run``;
  ``unpack``  (there)  ``.gpu_pack/`` -> ``.gpu_model/``, an HF folder (float32 safetensors,
                       config.json, tokenizer) that ``load_llama`` and ``bench suite --model``
                       read;
  ``run``     (there)  unpack, ``pytest -m gpu``, ``tune-tree --time-only`` (the tree this GPU
                       picks), ``bench layers`` (unrolled vs scanned), ``bench server_step``,
                       then ``bench suite --gpu`` on the unpacked model (``gpu_commands``).
                       ``--dry-run`` runs the same on CPU with the CPU-sized checks: unpack, the
                       unpacked weights against the GGUF reader's, one greedy generation, and
                       prints the GPU commands instead of running them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np

PACK = pathlib.Path(".gpu_pack")
MODEL = pathlib.Path(".gpu_model")
BLOCK = 32  # weights per Q4_1 / Q8_0 block
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
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


def pack(model: str, out: pathlib.Path, part_mib: float) -> list[pathlib.Path]:
  """Write the pack; returns its part files."""
  import gguf

  from redrafter_jax.weights import fetch
  from redrafter_jax.weights.llama_weights import (_GGUF_TO_HF, _gguf_field, _ignored,
                                                   gguf_config, read_llama)

  _, _, path = read_llama(model)  # resolves (and fetches) the GGUF; checks that it loads
  reader = gguf.GGUFReader(str(path))
  cfg = gguf_config(reader)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  # One stream of every tensor's bytes, cut into parts (a tensor may span two parts).
  stream, tensors, offset = [], [], 0
  for t in reader.tensors:
    if _ignored(t.name):
      continue
    raw = np.asarray(t.data).tobytes()
    tensors.append(dict(gguf=t.name, hf=_GGUF_TO_HF.to_ours(t.name)[0], type=t.tensor_type.name,
                        shape=[int(d) for d in reversed(t.shape)], offset=offset,
                        nbytes=len(raw)))
    stream.append(raw)
    offset += len(raw)
  data, limit = b"".join(stream), int(part_mib * 2 ** 20)
  parts = []
  for start in range(0, len(data), limit):
    parts.append(out / f"part-{len(parts)}.bin")
    parts[-1].write_bytes(data[start:start + limit])
  tok = fetch.model_path(model) if model in fetch.KNOWN_MODELS else path.parent
  tok_dir = tok.parent / "tokenizer" if tok.is_file() else tok / "tokenizer"
  if tok_dir.is_dir():
    shutil.copytree(tok_dir, out / "tokenizer")
  (out / "manifest.json").write_text(json.dumps(dict(
      config=cfg.to_hf(), arch=_gguf_field(reader, "general.architecture"), tensors=tensors,
      parts=[p.name for p in parts]), indent=1))
  return parts


def unpack(src: pathlib.Path, out: pathlib.Path) -> dict[str, np.ndarray]:
  """Write the HF folder; returns its tensors."""
  from safetensors.numpy import save_file

  from redrafter_jax.config import LlamaConfig
  from redrafter_jax.weights.llama_weights import unpermute_qk

  manifest = json.loads((src / "manifest.json").read_text())
  missing = [p for p in manifest["parts"] if not (src / p).is_file()]
  if missing:
    raise FileNotFoundError(f"{src}: parts {missing} have not arrived")
  cfg = LlamaConfig.from_hf(manifest["config"])
  data = b"".join((src / p).read_bytes() for p in manifest["parts"])
  tensors = {}
  for t in manifest["tensors"]:
    raw = data[t["offset"]:t["offset"] + t["nbytes"]]
    w = dequantize(raw, t["type"], tuple(t["shape"]))
    if manifest["arch"] == "llama" and (".attn_q." in t["gguf"] or ".attn_k." in t["gguf"]):
      w = unpermute_qk(w, cfg.num_heads if ".attn_q." in t["gguf"] else cfg.num_kv_heads)
    tensors[t["hf"]] = np.ascontiguousarray(w)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(manifest["config"], indent=1))
  if (src / "tokenizer").is_dir():
    for f in (src / "tokenizer").iterdir():
      shutil.copy(f, out / f.name)
  return tensors


def gpu_commands(model: pathlib.Path) -> list[list[str]]:
  """The GPU work: the ``gpu`` tests, the draft tree this GPU would pick (``tune-tree
  --time-only``: the shipped drafter's tokens/step with this device's step times), layers
  unrolled vs scanned (``bench layers``), a lone request's step by serving layer (``bench
  server_step``), then the suite's GPU preset (bf16, cuDNN, batch 1-16,
  AR vs ReDrafter, per-step split) and quick runs of the other two backends. Results go under
  ``$OUT/results`` when the device tool's ``$OUT`` is set (what it brings back), else
  ``results/``."""
  py = [sys.executable]
  out = str(pathlib.Path(os.environ["OUT"]) / "results") if os.environ.get("OUT") else "results"
  suite = py + ["-m", "redrafter_jax.bench", "suite", "--gpu", "--model", str(model),
                "--drafter", "shipped", "--no-progress", "--out", out]
  tune = py + ["-m", "redrafter_jax.cli", "tune-tree", "--time-only", "--model", str(model),
               "--param-dtype", "bfloat16"]
  layers = py + ["-m", "redrafter_jax.bench", "layers", "--model", str(model), "--param-dtype",
                 "bfloat16", "--out", str(pathlib.Path(out) / "layers.md")]
  server_step = py + ["-m", "redrafter_jax.bench", "server_step", "--model", str(model),
                      "--param-dtype", "bfloat16", "--out",
                      str(pathlib.Path(out) / "server_step.md")]
  return [py + ["-m", "pytest", "-q", "-m", "gpu", "tests"], tune, layers, server_step, suite,
          suite + ["--attention", "pallas", "--quick"], suite + ["--attention", "xla", "--quick"]]


def plan(src: pathlib.Path) -> list[str]:
  """The device calls that bring the pack over and run it (each carries one part)."""
  manifest = json.loads((src / "manifest.json").read_text())
  calls = []
  for i, p in enumerate(manifest["parts"]):
    carry = [str(src / p)] + ([str(src / "manifest.json"), str(src / "tokenizer")] if i == 0
                              else [])
    last = i == len(manifest["parts"]) - 1
    cmd = ("PYTHONPATH=$PWD/src python -m redrafter_jax.bench gpu_pack run" if last
           else f"ls -l {src}")
    calls.append(f"run(carry={json.dumps(carry)}, command={cmd!r})")
  return calls


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench gpu_pack",
                              description=__doc__.strip().splitlines()[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("pack")
  a.add_argument("--model", default="smollm2-135m")
  a.add_argument("--part-mib", type=float, default=20.0)
  for name in ("pack", "plan", "unpack", "run"):
    s = a if name == "pack" else sub.add_parser(name)
    s.add_argument("--src" if name != "pack" else "--out", type=pathlib.Path, default=PACK,
                   dest="pack")
    if name in ("unpack", "run"):
      s.add_argument("--model-out", type=pathlib.Path, default=MODEL)
    if name == "run":
      s.add_argument("--dry-run", action="store_true", help="CPU checks; print the GPU commands")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    if args.cmd == "pack":
      parts = pack(args.model, args.pack, args.part_mib)
      sizes = ", ".join(f"{p.name} {p.stat().st_size / 2 ** 20:.1f} MiB" for p in parts)
      print(f"{args.pack}: {len(parts)} parts ({sizes})")
      print("\n".join(plan(args.pack)))
    elif args.cmd == "plan":
      print("\n".join(plan(args.pack)))
    elif args.cmd == "unpack":
      unpack(args.pack, args.model_out)
      print(f"{args.model_out}: unpacked")
    else:
      return run(args)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def run(args) -> int:
  import jax

  tensors = unpack(args.pack, args.model_out)
  print(f"{args.model_out}: unpacked {len(tensors)} tensors; JAX on {jax.default_backend()}")
  if args.dry_run:
    from redrafter_jax.inference.ar import generate
    from redrafter_jax.weights.llama_weights import load_llama

    model, _ = load_llama(args.model_out)
    print("greedy tokens of [1, 2, 3]:", generate(model, [[1, 2, 3]], max_new_tokens=8).tokens[0])
    for cmd in gpu_commands(args.model_out):
      print("would run:", " ".join(cmd))
    return 0
  rc = 0
  env = dict(os.environ, JAX_PLATFORMS="cuda,cpu")  # the tests' conftest defaults to cpu
  for cmd in gpu_commands(args.model_out):
    print("running:", " ".join(cmd), flush=True)
    rc = max(rc, subprocess.call(cmd, env=env))
  return rc
