"""``redrafter-jax serve --config PRESET.yaml``: an OpenAI-compatible HTTP server with ReDrafter."""

import os

HELP = "serve the model over an OpenAI-compatible HTTP API (ReDrafter, streaming, batching)"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults

  show_defaults(p)
  p.add_argument("--config", required=True, help="YAML preset, e.g. configs/smollm2_135m.yaml")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override preset values, e.g. decode.beam_width=2")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on")
  drafting = p.add_mutually_exclusive_group()
  drafting.add_argument("--drafter", default=None,
                        help="drafter folder (default: the preset's drafter_path)")
  drafting.add_argument("--random-drafter", action="store_true",
                        help="a randomly initialised drafter (tests; accepts almost nothing)")
  drafting.add_argument("--ar", action="store_true",
                        help="no speculation: plain autoregressive steps (for comparison)")
  p.add_argument("--tree", choices=("auto", "preset"), default="auto",
                 help="auto: the draft tree predicted fastest on this device for the drafter "
                 "(timed once, cached; the preset's when the drafter has no acceptance.json); "
                 "preset: the preset's decode settings")
  p.add_argument("--trees", default="", metavar="WxL[+n][/N],...",
                 help="smaller draft trees to run instead of the served one when they give a "
                 "step's rows more tokens per second (e.g. 1x2+3/3,1x3+3/4; those that do not fit "
                 "within the served tree are skipped); each adds step programs to the warm-up")
  p.add_argument("--slots", type=int, default=8, help="requests decoded together (batch rows)")
  p.add_argument("--max-context", type=int, default=None,
                 help="KV-cache slots per request: prompt + max_tokens + scratch "
                      "(default: min(2048, the model's context))")
  p.add_argument("--min-context-bucket", type=int, default=512,
                 help="steps read only a power-of-two bucket of the cache from this size up to "
                 "--max-context (each compiled at start-up); --max-context's value turns it off")
  p.add_argument("--prefill-tokens", type=int, default=1024,
                 help="padded prompt tokens one admission call prefills: waiting prompts of one "
                 "length bucket are prefilled together up to this many (1: one per call)")
  p.add_argument("--max-tokens", type=int, default=512,
                 help="the largest max_tokens a request may ask for")
  p.add_argument("--default-max-tokens", type=int, default=None,
                 help="max_tokens when a request gives none (default: decode.max_new_tokens)")
  p.add_argument("--max-queue", type=int, default=64,
                 help="requests that may wait for a slot; more get HTTP 429")
  p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                 help="largest request body accepted; larger ones get HTTP 413 (default 1 MiB)")
  p.add_argument("--shutdown-grace", type=float, default=30.0,
                 help="seconds requests in flight get to finish after SIGTERM/SIGINT (new ones "
                      "get 503); then they end with an error event (default 30)")
  p.add_argument("--api-key", default=os.environ.get("REDRAFTER_API_KEY"),
                 help="require 'Authorization: Bearer KEY' on /v1 routes (401 otherwise; "
                      "/health and /metrics stay open); default: $REDRAFTER_API_KEY, else none")
  p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                 help="let browser pages from ORIGIN call the API (repeatable; '*' for any)")
  p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                 help="accept only requests whose Host header names HOST (repeatable; "
                      "'*.example.com' patterns); default: any Host")
  p.add_argument("--devices", type=int, default=None,
                 help="devices on the tensor-parallel model axis (default: all local devices)")
  p.add_argument("--served-model-name", default=None,
                 help="the model id clients use (default: the preset's model)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="keep compiled programs in DIR, so a restart loads them instead of "
                      "compiling again (default: xla/ in the model cache folder, "
                      "$REDRAFTER_JAX_CACHE or ~/.cache/redrafter_jax; 'off' to disable; "
                      "never on a CPU server over several devices, where cached programs hang)")
  p.add_argument("--no-warmup", action="store_true",
                 help="skip compiling every prompt bucket and step mode before accepting "
                      "requests (the first request of each kind then waits for a compile)")


def run(args) -> int:
  from redrafter_jax.config import load_preset, parse_overrides
  from redrafter_jax.serving import server

  preset = load_preset(args.config, parse_overrides(args.overrides))
  server.preflight(preset, speculative=not args.ar, drafter_path=args.drafter,
                   random_drafter=args.random_drafter)
  server.use_compile_cache(args.compile_cache, args.devices)
  build = lambda startup: server.build(
      preset, slots=args.slots, max_context=args.max_context, max_tokens=args.max_tokens,
      min_context_bucket=args.min_context_bucket, prefill_tokens=args.prefill_tokens,
      default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
      speculative=not args.ar, drafter_path=args.drafter, random_drafter=args.random_drafter,
      devices=args.devices, model_name=args.served_model_name, warmup=not args.no_warmup,
      max_body_bytes=args.max_body_bytes, api_key=args.api_key,
      cors_origins=args.cors_origin, allowed_hosts=args.allowed_host, tree=args.tree,
      trees=[t for t in args.trees.split(",") if t.strip()], startup=startup)
  server.serve_forever(build, args.host, args.port, shutdown_grace=args.shutdown_grace)
  return 0
