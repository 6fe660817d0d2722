"""`eaglespec serve`: command-line options, then uvicorn over the app. Heavy imports happen in `cmd_serve`."""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Callable

from .. import envs
from ..cli import positive_int

API_KEY_ENV = envs.API_KEY


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def register(subparsers, model_options: Callable, sampling_options: Callable) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (chat, completions, streaming, Prometheus metrics)",
        description="Serve the model over an OpenAI-compatible API: POST /v1/chat/completions, "
                    "POST /v1/completions, GET /v1/models, GET /health, GET /metrics.")
    model_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health "
                        f"(default: the {API_KEY_ENV} environment variable; none if unset)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the --model value)")
    g.add_argument("--max-queue", type=positive_int, default=64,
                   help="requests allowed to wait for the generation thread; more get 503 (default: 64)")
    g.add_argument("--timeout", type=_positive_float, default=600.0,
                   help="seconds a request may take from arrival to its last token, queue included (default: 600)")
    g.add_argument("--max-tokens-limit", type=positive_int, default=2048,
                   help="largest max_tokens a request may ask for; also caps chat requests without one "
                        "(default: 2048)")
    g.add_argument("--max-batch", type=positive_int, default=None,
                   help="requests decoded together in one batch (continuous batching: a finished request's slot "
                        "goes to the next waiting one); 1 decodes one request at a time (default: 8 on a CPU, "
                        "64 on a GPU)")
    g.add_argument("--speculate", choices=["auto", "always", "never"], default="auto",
                   help="with --max-batch above 1: which sequences draft each step; auto drafts where the measured "
                        "cost of rows at the current batch width and each sequence's acceptance say it pays "
                        "(default: auto)")
    g.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="with --max-batch above 1: prompt rows a step reads while other requests decode (a new "
                        "request's prompt is read in pieces beside their steps; larger: sooner first tokens for new "
                        "requests, longer pauses for running ones; default: 32)")
    g.add_argument("--prefix-cache-mb", type=float, default=256.0,
                   help="with --max-batch above 1: memory for the KV rows of prompts read before; a prompt starting "
                        "like one of them (a system prompt) reads only the rest (exact; 0: off; default: 256)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    import prometheus_client
    import uvicorn

    from ..api import default_max_batch
    from ..cli import build_engine
    from ..spec.batch import PREFILL_CHUNK
    from .app import ServerConfig, create_app
    from .thread import GenerationThread

    api_key = args.api_key if args.api_key is not None else envs.api_key()
    if not _is_loopback(args.host) and not api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach this port can use it "
              f"(set --api-key or {API_KEY_ENV})", file=sys.stderr)
    thread = GenerationThread()  # every torch call of the server on one thread (serve/thread.py)
    engine = thread.call(build_engine, args)
    max_batch = args.max_batch or default_max_batch(engine.target.device)
    config = ServerConfig(model_name=args.served_model_name or args.model, api_key=api_key,
                          max_queue=args.max_queue, timeout=args.timeout, max_tokens_limit=args.max_tokens_limit,
                          max_batch=max_batch, speculate=args.speculate,
                          prefill_chunk=args.prefill_chunk or PREFILL_CHUNK,
                          prefix_cache_bytes=int(max(args.prefix_cache_mb, 0.0) * 2**20))
    prometheus_client.disable_created_metrics()  # no `*_created` series (as vLLM): this process is the server
    app = create_app(engine, config, thread)
    print(f"eaglespec: serving '{config.model_name}' (method {engine.method}, batches of up to {max_batch}) on "
          f"http://{args.host}:{args.port}/v1"
          f"{' with an API key' if api_key else ''}", file=sys.stderr)
    # On shutdown, streams still open after a few seconds are cancelled, which stops their generations.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
