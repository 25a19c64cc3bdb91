"""``redrafter-jax export``: write a drafter in the reference / MLX layout, or as the drafter's
part of a TensorRT-LLM checkpoint (docs/export.md: TensorRT-LLM's own converter builds
the whole checkpoint from the reference layout)."""

from redrafter_jax.weights import drafter_io

HELP = "export a drafter to the Apple reference, MLX or TensorRT-LLM format"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--drafter", required=True,
                 help="drafter folder in any supported format (reference, MLX, TensorRT-LLM)")
  p.add_argument("--format", choices=drafter_io.FORMATS, default="mlx",
                 help="output format (reference and mlx are the same layout; trtllm is the "
                 "drafter's part of a TensorRT-LLM checkpoint only, without the base model)")
  p.add_argument("--dtype", choices=sorted(drafter_io.DTYPE_ALIASES), default="fp32",
                 help="dtype of the written tensors")
  p.add_argument("--out", required=True, help="output folder (must be empty or absent)")
  p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
  p.add_argument("--head-rows", type=int, default=0, metavar="R",
                 help="reference and redrafter-jax formats: keep only the head rows of the R "
                 "top-ranked tokens (the draft vocabulary the drafter trained; refused if any "
                 "other row is non-zero). Read back by this library; MLX and TensorRT-LLM need "
                 "the full head")


def run(args) -> int:
  drafter = drafter_io.load_drafter(args.drafter)
  out = drafter_io.save_drafter(drafter, args.out, format=args.format, dtype=args.dtype,
                                overwrite=args.overwrite, head_rows=args.head_rows)
  print(out)
  return 0
