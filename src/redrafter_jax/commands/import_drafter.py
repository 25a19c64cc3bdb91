"""``redrafter-jax import``: read a drafter in any supported layout, write our reference folder."""

from redrafter_jax.weights import drafter_io

HELP = ("import a drafter (reference, MLX, TensorRT-LLM, lm_heads.* or 0.{i}.* layouts) into the "
        "canonical reference folder")


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--src", required=True, help="drafter folder (config.json + safetensors)")
  p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
  p.add_argument("--dtype", choices=sorted(drafter_io.DTYPE_ALIASES), default="fp32",
                 help="dtype of the written tensors")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")


def run(args) -> int:
  drafter = drafter_io.load_drafter(args.src)  # logs which layout it found
  out = drafter_io.save_drafter(drafter, args.out, format="reference", dtype=args.dtype,
                                overwrite=args.overwrite)
  print(out)
  return 0
