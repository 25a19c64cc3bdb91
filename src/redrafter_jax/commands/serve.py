"""``redrafter-jax serve --config PRESET.yaml``: an OpenAI-compatible HTTP server with ReDrafter.

Every setting is a ``config.ServeConfig`` field: the preset's ``serve:`` section gives it, and a
flag given here overrides that (each flag's ``dest`` is the field's name)."""

import dataclasses
import os

HELP = "serve the model over an OpenAI-compatible HTTP API (ReDrafter, streaming, batching)"


def add_arguments(p):
  from redrafter_jax.commands import show_defaults
  from redrafter_jax.config import ServeConfig

  base = ServeConfig()

  def default(name: str, text: str | None = None) -> str:
    """The flag's default: the preset's serve.NAME, else ServeConfig's (or ``text``)."""
    value = getattr(base, name)
    return f"(default: the preset's serve.{name}, else {text or value})"

  show_defaults(p)
  p.add_argument("--config", required=True, help="YAML preset, e.g. configs/smollm2_135m.yaml")
  p.add_argument("overrides", nargs="*", metavar="section.key=value",
                 help="override preset values, e.g. decode.beam_width=2 or serve.slots=4")
  p.add_argument("--host", default=None, help=f"address to listen on {default('host')}")
  p.add_argument("--port", type=int, default=None, help=f"port to listen on {default('port')}")
  drafting = p.add_mutually_exclusive_group()
  drafting.add_argument("--drafter", default=None,
                        help="drafter folder (default: the preset's drafter_path)")
  drafting.add_argument("--random-drafter", dest="random_drafter", action="store_const",
                        const=True, default=None,
                        help="a randomly initialised drafter (tests; accepts almost nothing)")
  drafting.add_argument("--ar", dest="speculative", action="store_const", const=False,
                        default=None,
                        help="no speculation: plain autoregressive steps (for comparison)")
  p.add_argument("--tree", choices=("auto", "preset"), default=None,
                 help="auto: the draft tree predicted fastest on this device for the drafter "
                 "(timed once, cached; the preset's when the drafter has no acceptance.json); "
                 f"preset: the preset's decode settings {default('tree')}")
  p.add_argument("--trees", default=None, metavar="WxL[+n][+aK][/N],...",
                 help="smaller draft trees to run instead of the served one when they give a "
                 "step's rows more tokens per second (e.g. 1x2+3/3,1x3+3/4; those that do not fit "
                 "within the served tree are skipped); each adds step programs to the warm-up "
                 f"{default('trees', 'none')}")
  p.add_argument("--slots", type=int, default=None,
                 help=f"requests decoded together (batch rows) {default('slots')}")
  p.add_argument("--max-context", type=int, default=None,
                 help="KV-cache slots per request: prompt + max_tokens + scratch "
                      f"{default('max_context', 'min(2048, the model context)')}")
  p.add_argument("--min-context-bucket", type=int, default=None,
                 help="steps read only a power-of-two bucket of the cache from this size up to "
                 "--max-context (each compiled at start-up); --max-context's value turns it off "
                 f"{default('min_context_bucket')}")
  p.add_argument("--prefill-tokens", type=int, default=None,
                 help="padded prompt tokens one admission call prefills: waiting prompts of one "
                 "length bucket are prefilled together up to this many (1: one per call) "
                 f"{default('prefill_tokens')}")
  p.add_argument("--max-tokens", type=int, default=None,
                 help=f"the largest max_tokens a request may ask for {default('max_tokens')}")
  p.add_argument("--default-max-tokens", type=int, default=None,
                 help="max_tokens when a request gives none "
                      f"{default('default_max_tokens', 'decode.max_new_tokens')}")
  p.add_argument("--max-queue", type=int, default=None,
                 help=f"requests that may wait for a slot; more get HTTP 429 "
                      f"{default('max_queue')}")
  p.add_argument("--max-body-bytes", type=int, default=None,
                 help="largest request body accepted; larger ones get HTTP 413 "
                      f"{default('max_body_bytes', '1 MiB')}")
  p.add_argument("--shutdown-grace", type=float, default=None,
                 help="seconds requests in flight get to finish after SIGTERM/SIGINT (new ones "
                      "get 503); then they end with an error event "
                      f"{default('shutdown_grace')}")
  p.add_argument("--api-key", default=None,
                 help="require 'Authorization: Bearer KEY' on /v1 routes (401 otherwise; "
                      "/health and /metrics stay open) (default: $REDRAFTER_API_KEY, else the "
                      "preset's serve.api_key, else none)")
  p.add_argument("--cors-origin", dest="cors_origins", action="append", default=None,
                 metavar="ORIGIN",
                 help="let browser pages from ORIGIN call the API (repeatable; '*' for any) "
                 f"{default('cors_origins', 'none')}")
  p.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=None,
                 metavar="HOST",
                 help="accept only requests whose Host header names HOST (repeatable; "
                      f"'*.example.com' patterns) {default('allowed_hosts', 'any Host')}")
  p.add_argument("--devices", type=int, default=None,
                 help="devices on the tensor-parallel model axis "
                      f"{default('devices', 'all local devices')}")
  p.add_argument("--served-model-name", dest="model_name", default=None,
                 help=f"the model id clients use {default('model_name', 'the preset model')}")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="keep compiled programs in DIR, so a restart loads them instead of "
                      "compiling again ('off' to disable; never on a CPU server over several "
                      "devices, where cached programs hang) (default: the preset's "
                      "serve.compile_cache, else xla/ in the model cache folder, "
                      "$REDRAFTER_JAX_CACHE or ~/.cache/redrafter_jax)")
  p.add_argument("--no-warmup", dest="warmup", action="store_const", const=False, default=None,
                 help="compile nothing before accepting requests (the first request of each "
                      "kind then waits for a compile) (default: compile a covering set of "
                      "programs, ready sooner, and the rest in the background)")
  p.add_argument("--memory-limit-gb", dest="memory_limit_gb", type=float, default=None,
                 metavar="GB",
                 help="stop the background compile before the process's resident memory would "
                 "pass GB; requests the programs left out would serve run padded to larger "
                 f"ones {default('memory_limit_gb', 'no limit')}")
  p.add_argument("--warmup-all", dest="warmup_all", action="store_const", const=True,
                 default=None, help="compile every prompt bucket and step mode before "
                                    "accepting requests (default: the preset's "
                                    "serve.warmup_all, else off)")


def serve_config(args, preset):
  """The preset with ``--drafter`` applied, and its ``serve`` settings with every flag given
  (not None) applied: ``(preset, ServeConfig)``."""
  from redrafter_jax.config import ServeConfig

  if args.drafter is not None:
    preset = dataclasses.replace(preset, drafter_path=args.drafter)
  given = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeConfig)
           if getattr(args, f.name, None) is not None}
  if "api_key" not in given and os.environ.get("REDRAFTER_API_KEY"):
    given["api_key"] = os.environ["REDRAFTER_API_KEY"]
  return preset, dataclasses.replace(preset.serve, **given)


def run(args) -> int:
  from redrafter_jax.config import load_preset, parse_overrides
  from redrafter_jax.serving import server

  preset, serve = serve_config(args, load_preset(args.config, parse_overrides(args.overrides)))
  server.preflight(preset, serve)
  server.use_compile_cache(serve.compile_cache, serve.devices)
  server.serve_forever(preset, serve)
  return 0
