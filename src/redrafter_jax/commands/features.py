"""``redrafter-jax features``: the frozen LLM's hidden states over a data folder, once."""

from redrafter_jax.errors import UserError

HELP = "precompute the LLM's hidden states over distillation data (train.features)"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--data", required=True, help="data folder written by distill-data")
  p.add_argument("--out", required=True, help="features folder (resumed if it exists)")
  p.add_argument("--seq-len", type=int, required=True,
                 help="train.seq_len of the runs that will read it (long records are windowed)")
  p.add_argument("--model", default="smollm2-135m",
                 help="base model: known name, GGUF/HF path, or random:<spec> (tests)")
  p.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                 help="stored precision (float16: half the disk)")
  p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per forward")
  p.add_argument("--feature-layers", type=int, nargs="+", default=(), metavar="LAYER",
                 help="also store these decoder layers' states (a drafter's "
                      "drafter.feature_layers)")
  p.add_argument("--max-shards", type=int, default=None,
                 help="stop after this many new shards (rerun to continue)")


def run(args) -> int:
  from redrafter_jax.training import features
  from redrafter_jax.training.data import DataError
  from redrafter_jax.weights import base_model

  if args.seq_len < 1 or args.batch_tokens < 1:
    raise UserError("--seq-len and --batch-tokens must be >= 1")
  try:
    llm, _ = base_model.load_base_model(args.model)
    stats = features.write_features(llm, args.data, args.out, model_name=args.model,
                                    seq_len=args.seq_len, dtype=args.dtype,
                                    batch_tokens=args.batch_tokens, max_shards=args.max_shards,
                                    feature_layers=tuple(args.feature_layers))
  except DataError as e:
    raise UserError(str(e)) from e
  print(f"{args.out}: wrote {stats['shards']} shard(s), {stats['tokens']} tokens, "
        f"{stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tok/s")
  return 0
