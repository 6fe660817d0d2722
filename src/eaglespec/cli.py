"""Command line: `eaglespec generate | chat | train | export | bench | serve`.

generate and chat live here; other subcommands register themselves from their own packages (see
SUBCOMMAND_MODULES), each with `register(subparsers, common)`. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import EagleSpecError

SUBCOMMAND_MODULES = ("eaglespec.train.cli", "eaglespec.bench.cli", "eaglespec.serve.cli")


DEVICE_HELP = "auto (default) = the first CUDA GPU torch sees, else cpu; or cpu, cuda, cuda:N"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def model_options(p: argparse.ArgumentParser) -> None:
    """--model, --head, --method, --device, --dtype, --threads and tree settings (shared by generate, chat, bench,
    serve)."""
    from .drafters import METHODS
    from .models import DEFAULT_MODEL

    g = p.add_argument_group("model and drafting")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, transformers model folder or .gguf file (default: {DEFAULT_MODEL})")
    g.add_argument("--head", default="auto",
                   help="draft head folder (EAGLE / EAGLE-3 layout); 'auto' = the head shipped for --model")
    g.add_argument("--method", default="eagle2", choices=METHODS,
                   help="eagle2 = dynamic tree, eagle1 = static tree, chain = top-1, vanilla = no draft, "
                        "pld = prompt lookup, sps = a smaller draft model (--draft-model)")
    g.add_argument("--draft-model", default=None, help="sps: a smaller model sharing the target's tokenizer")
    g.add_argument("--device", default="auto", help=DEVICE_HELP)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default) = bfloat16 on a GPU (float16 before Ampere), a CPU with native bfloat16 "
                        "(AVX-512 BF16 / AMX) or one where eaglespec's kernels run (AVX2 + FMA), else float32")
    g.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"],
                   help="target forward: fast = our lean Llama/Qwen2 path, hf = transformers (auto: fast if supported)")
    g.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="CPU fast path: int8 / int4 weight-only target (2-4x fewer bytes per step; changes the "
                        "model slightly, like a Q8_0 / Q4_1 GGUF; output stays lossless w.r.t. it). Default none")
    g.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="every verified row bit-identical to a one-token step, so greedy output equals plain "
                        "decoding's token for token. Default: on for the fast path on a CPU (free with eaglespec's "
                        "kernels, AVX-512 BF16 or AVX2 + FMA; row-by-row attention elsewhere), off on a GPU. "
                        "--no-exact: batched attention (faster without the kernels; greedy output may then differ "
                        "from plain decoding's where two tokens nearly tie)")
    g.add_argument("--compile", action="store_true",
                   help="fast path: run the target's decode steps through torch.compile (fuses the small operations "
                        "between matrix products; needs a C++ compiler on a CPU; compiles for minutes the first "
                        "time, cached on disk after). Not with --quantize")
    g.add_argument("--threads", type=positive_int, default=None, help="CPU threads for torch (default: torch's)")
    g.add_argument("--tree", default="auto", choices=["auto", "calibrate", "fixed"],
                   help="auto = this machine's calibrated tree (total_tokens / depth / top_k), else a default for its "
                        "CPU class, drafting only while that measures faster; calibrate = measure for this machine "
                        "and head now (a minute or two; cached unless other processes disturbed it); fixed = the "
                        "settings below (giving any of them implies fixed)")
    g.add_argument("--total-tokens", type=positive_int, default=None, help="EAGLE-2: tree nodes verified per step (16)")
    g.add_argument("--depth", type=positive_int, default=None, help="EAGLE-2 / chain: draft levels (5)")
    g.add_argument("--tree-top-k", type=positive_int, default=None, help="EAGLE-2: children per expanded node (4)")
    g.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="EAGLE-1 head: draft over its N most frequent tokens (default: the head's own setting; "
                        "0 = the full vocabulary)")


def tree_from_args(args: argparse.Namespace):
    """'auto' or explicit TreeSettings from --tree / --total-tokens / --depth / --tree-top-k."""
    from .drafters import TreeSettings

    given = {k: getattr(args, a) for k, a in (("total_tokens", "total_tokens"), ("depth", "depth"),
                                             ("top_k", "tree_top_k")) if getattr(args, a, None) is not None}
    if args.tree in ("auto", "calibrate") and not given:
        return args.tree
    return TreeSettings(**given)


def sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system message for the chat template")


def check_options(args: argparse.Namespace) -> None:
    """Reject bad options before any model is loaded (loading takes seconds)."""
    from pathlib import Path

    from .decode import MAX_NEW_TOKENS_LIMIT
    from .verify import SamplingParams

    if hasattr(args, "temperature"):
        SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise EagleSpecError(f"--max-new-tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, "
                                 f"got {args.max_new_tokens}")
    if getattr(args, "device", None) is not None:
        from .platform import parse_device

        args.device = parse_device(args.device)
    if getattr(args, "draft_vocab", None) is not None and args.draft_vocab < 0:
        raise EagleSpecError(f"--draft-vocab must be 0 (full vocabulary) or a positive size, got {args.draft_vocab}")
    if getattr(args, "compile", False) and getattr(args, "quantize", "none") != "none":
        from .compiled import CONFLICT

        raise EagleSpecError(CONFLICT)
    if args.head not in ("auto", None, "") and not (Path(args.head) / "config.json").is_file():
        raise EagleSpecError(f"--head '{args.head}' is not a head folder (no config.json there)")
    if getattr(args, "prompt", None) is not None and not args.prompt.strip():
        raise EagleSpecError("the prompt is empty: give some text, e.g. eaglespec generate \"Hello\"")


def build_engine(args: argparse.Namespace):
    """An Engine from the shared options; prints its notice (the tree auto choice, adaptation, fallbacks)."""
    import torch

    from .api import Engine

    check_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, head=args.head, method=args.method, device=args.device, dtype=args.dtype,
                    tree=tree_from_args(args), draft_model=args.draft_model, backend=args.backend,
                    draft_vocab=args.draft_vocab, quantize=args.quantize, exact=args.exact, compile=args.compile)
    if engine.notice:
        print(f"note: {engine.notice}", file=sys.stderr)
    return engine


def _stream_to_terminal(engine, prompt, args) -> object:
    from .decode import Finished

    result = None
    for item in engine.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                              chat=False if getattr(args, "raw", False) else None, system=args.system):
        if isinstance(item, Finished):
            result = item
        else:
            print(item.text, end="", flush=True)
    print()
    s = result.stats
    drafted = (f", {s.drafted_forwards} of {s.target_forwards} steps drafted"
               if engine.method != "vanilla" and s.drafted_forwards < s.target_forwards else "")
    print(f"[{s.new_tokens} tokens in {s.total_time:.2f}s: {s.tokens_per_s:.1f} tokens/s, tau {s.tau:.2f}, "
          f"method {engine.method}{drafted}, {s.finish_reason}]", file=sys.stderr)
    return result


def cmd_generate(args: argparse.Namespace) -> int:
    engine = build_engine(args)
    _stream_to_terminal(engine, args.prompt, args)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = build_engine(args)
    history: list[dict] = []
    print("eaglespec chat: type a message, /reset to clear the history, /quit or Ctrl-D to leave.", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        try:
            result = _stream_to_terminal(engine, history, args)
        except EagleSpecError as exc:
            history.pop()
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": result.text})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglespec", description="Lossless EAGLE speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate an answer to one prompt, streamed to the terminal")
    p.add_argument("prompt", help="the prompt (sent through the model's chat template unless --raw)")
    p.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template")
    model_options(p)
    sampling_options(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    model_options(p)
    sampling_options(p)
    p.set_defaults(func=cmd_chat)

    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # that subcommand is not part of this installation
            raise
        module.register(sub, model_options=model_options, sampling_options=sampling_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EagleSpecError as exc:
        print(f"eaglespec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
