"""Command line: `eaglespec generate | chat | train | export | bench | serve`.

generate and chat live here; other subcommands register themselves from their own packages (see
SUBCOMMAND_MODULES), each with `register(subparsers, common)`. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING

from .errors import EagleSpecError

if TYPE_CHECKING:
    from .drafters import TreeSettings

SUBCOMMAND_MODULES = ("eaglespec.train.cli", "eaglespec.bench.cli", "eaglespec.serve.cli")


DEVICE_HELP = "auto (default: the first CUDA GPU torch sees, else cpu), cpu, cuda or cuda:N"

# --help lists the everyday options first, then the engine switches, whose defaults suit most machines.
EVERYDAY = "everyday options"
ENGINE = "engine options (advanced)"
ENGINE_DESCRIPTION = "their defaults suit most uses (README.md: 'What the defaults do')"
TREE_USAGE = "--tree takes auto, calibrate or TOTAL,DEPTH,TOP_K such as 16,5,4"
# what a GGUF model's block products multiply the weights with (backends.cpu.apply.ACTIVATIONS; a test keeps the
# two equal: the command line spells them here so that --help loads no torch)
ACTIVATIONS = ("auto", "bfloat16", "int8")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def option_group(p: argparse.ArgumentParser, title: str,
                 description: str | None = None) -> argparse._ArgumentGroup:
    """The parser's argument group with this title, made on first use, so that model_options, sampling_options and
    a subcommand's own everyday options (generate's --raw) land in one group of --help."""
    for group in p._action_groups:  # argparse offers no public look-up of a parser's groups
        if group.title == title:
            return group
    return p.add_argument_group(title, description)


class _WithinTree(argparse.Action):
    """--total-tokens, --depth and --tree-top-k, unlisted: one line pointing at --tree, where these numbers go, in
    place of argparse's "unrecognized arguments" (or, under bench, a complaint about its value)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string} is given within --tree TOTAL,DEPTH,TOP_K, "
                       f"such as --tree 16,5,4\n")


def model_options(p: argparse.ArgumentParser) -> None:
    """The model and drafting options (everyday) and the engine switches (advanced), shared by generate, chat,
    bench and serve."""
    from .drafters import METHODS
    from .models import DEFAULT_MODEL

    g = option_group(p, EVERYDAY)
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered name, transformers model folder or .gguf file (default: {DEFAULT_MODEL})")
    g.add_argument("--head", default="auto", metavar="DIR",
                   help="draft head folder (EAGLE / EAGLE-3 layout); auto (default) = the head shipped for --model")
    g.add_argument("--method", default="eagle2", choices=METHODS, metavar="METHOD",
                   help="eagle2 (default), eagle1, chain, vanilla (no draft), pld (prompt lookup), sps, "
                        "staged")
    g.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="with --method sps or staged: a smaller model sharing the target's tokenizer")
    g.add_argument("--tree", default="auto", metavar="TREE",
                   help="auto (default), calibrate (measure now) or a fixed TOTAL,DEPTH,TOP_K such as 16,5,4")

    e = option_group(p, ENGINE, ENGINE_DESCRIPTION)
    e.add_argument("--device", default="auto", help=DEVICE_HELP)
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on a GPU or where eaglespec's CPU kernels run, else float32")
    e.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's)")
    e.add_argument("--backend", default="auto", choices=["auto", "fast", "hf"],
                   help="fast (eaglespec's Llama / Qwen2 path), hf (transformers); auto (default): fast "
                        "where supported")
    e.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy output equals plain decoding's (default: on for the fast path on a CPU, off "
                        "on a GPU)")
    e.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (minutes the first time, cached after)")
    e.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="int8 / int4 weight-only target on a CPU (a slightly different model, decoded "
                        "losslessly)")
    e.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                   help="GGUF block products' inputs (auto: int8 where faster)")
    e.add_argument("--ngram", default="auto", metavar="FILE",
                   help="stage-2 n-gram model for staged or --extend (auto: the draft model's; none)")
    e.add_argument("--extend", type=int, default=None, metavar="N",
                   help="EAGLE heads: up to N stage-2 guesses (n-grams) added to each draft tree "
                        "(default: the model's)")
    e.add_argument("--longest-chain", type=positive_int, default=None, metavar="N",
                   help="sps, staged under --tree auto: the longest chain a round drafts (default: 15 with AMX, "
                        "else 5)")
    e.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="EAGLE-1 head: draft over its N most frequent tokens (0: all; default: the head's)")
    for option in ("--total-tokens", "--depth", "--tree-top-k"):
        p.add_argument(option, action=_WithinTree, nargs="?", help=argparse.SUPPRESS)


def parse_tree(text: str) -> str | TreeSettings:
    """A --tree value: "auto", "calibrate" or TreeSettings from TOTAL,DEPTH,TOP_K (validated there)."""
    from .drafters import TreeSettings

    value = text.strip().lower()
    if value in ("auto", "calibrate"):
        return value
    parts = [part.strip() for part in value.split(",")]
    if len(parts) != 3 or not all(part.isdecimal() for part in parts):
        # the word 'fixed' once meant "the numbers given by separate options"; say how to write those now
        hint = ": a fixed tree is given by its numbers, the defaults being 16,5,4" if value == "fixed" else ""
        raise EagleSpecError(f"{TREE_USAGE}, got '{text}'{hint}")
    total, depth, top_k = (int(part) for part in parts)
    try:
        return TreeSettings(total_tokens=total, depth=depth, top_k=top_k)
    except EagleSpecError as exc:
        raise EagleSpecError(f"--tree {text}: {exc}") from None


def tree_from_args(args: argparse.Namespace) -> str | TreeSettings:
    """'auto', 'calibrate' or explicit TreeSettings from --tree."""
    from .drafters import TreeSettings

    if isinstance(args.tree, TreeSettings):  # (a namespace built in code may carry the settings themselves)
        return args.tree
    return parse_tree(args.tree)


def sampling_options(p: argparse.ArgumentParser) -> None:
    """Length and sampling options, in the everyday group (after model_options' everyday options)."""
    g = option_group(p, EVERYDAY)
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep this much probability (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens (default: 0, all)")
    g.add_argument("--seed", type=int, default=None, metavar="N", help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--system", default=None, metavar="TEXT", help="system message for the chat template")


def check_engine_options(args: argparse.Namespace) -> None:
    """Engine switches that cannot work together (also bench's): one line saying what to drop."""
    quantize = getattr(args, "quantize", "none")
    if getattr(args, "compile", False) and quantize != "none":
        from .backends.cpu.compiled import CONFLICT

        raise EagleSpecError(CONFLICT)
    if getattr(args, "backend", "auto") == "hf":
        fast_only = ([f"--quantize {quantize}"] * (quantize != "none")
                     + ["--activations int8"] * (getattr(args, "activations", "auto") == "int8")
                     + ["--exact"] * bool(getattr(args, "exact", None))
                     + ["--compile"] * bool(getattr(args, "compile", False)))
        if fast_only:
            listed = " and ".join(fast_only)
            raise EagleSpecError(f"{listed} {'need' if len(fast_only) > 1 else 'needs'} eaglespec's fast path: "
                                 f"drop --backend hf or {listed}")
    if quantize != "none" and getattr(args, "device", None) is not None:
        from .backends.cpu.quant import check_mode
        from .platform import parse_device

        check_mode(quantize, parse_device(args.device))  # a GPU: says to use --dtype bfloat16 or --device cpu


def check_longest_chain(args: argparse.Namespace, draft_model: bool) -> None:
    """--longest-chain caps a draft model's chain (`draft_model`: the method drafts with one) under --tree auto."""
    if getattr(args, "longest_chain", None) is None:
        return
    from .drafters import tree_chosen_by_run

    if not draft_model:
        raise EagleSpecError("--longest-chain caps the draft model's chain of --method sps or staged: add one or drop "
                             "--longest-chain")
    if not tree_chosen_by_run(tree_from_args(args)):
        raise EagleSpecError(f"--longest-chain caps the chain whose length --tree auto chooses each round; --tree "
                             f"{args.tree} fixes it: drop one of them")


def extend_from_args(args: argparse.Namespace, head_drafts: bool = True) -> int:
    """`--extend` as given, else the model's default where a head drafts (`head_drafts`) and 0 elsewhere."""
    from .models import default_extend

    extend = getattr(args, "extend", None)
    if extend is None:
        return default_extend(args.model) if head_drafts else 0
    if extend < 0:
        raise EagleSpecError(f"--extend must be 0 (none) or a positive count of guesses, got {extend}")
    return extend


def check_combinations(args: argparse.Namespace) -> None:
    """Options that cannot work together with --method: one line saying what to drop, before any model loads."""
    from .drafters import DRAFT_MODEL_METHODS, HEAD_METHODS

    check_engine_options(args)
    method = args.method
    if args.draft_model and method not in DRAFT_MODEL_METHODS:
        raise EagleSpecError("--draft-model drafts for --method sps or staged: add one or drop --draft-model")
    if method in DRAFT_MODEL_METHODS and not args.draft_model:
        raise EagleSpecError(f"--method {method} needs --draft-model MODEL, a smaller model sharing the target's "
                             "tokenizer")
    extend = extend_from_args(args, method in HEAD_METHODS)
    if extend and method not in HEAD_METHODS:
        raise EagleSpecError(f"--extend continues an EAGLE head's draft; --method {method} has no head: drop --extend")
    if getattr(args, "ngram", None) not in (None, "auto", "none") and method != "staged" and not extend:
        raise EagleSpecError("--ngram is the second stage of --method staged (or of --extend N with a head): add one "
                             "or drop --ngram")
    check_longest_chain(args, method in DRAFT_MODEL_METHODS)
    if method not in HEAD_METHODS:
        if args.head not in ("auto", None, ""):
            raise EagleSpecError(f"--method {method} drafts without a head: drop --head")
        if args.draft_vocab is not None:
            raise EagleSpecError(f"--draft-vocab sets a draft head's vocabulary; --method {method} has no head: "
                                 "drop --draft-vocab")
    tree = tree_from_args(args)
    if tree == "auto":
        return
    if method == "vanilla":
        raise EagleSpecError(f"--method vanilla drafts nothing: drop --tree {args.tree}")
    if method == "eagle1" and tree != "calibrate":
        raise EagleSpecError(f"--method eagle1 drafts the head's static tree: drop --tree {args.tree}")
    if tree == "calibrate" and method not in ("eagle2", "chain"):
        raise EagleSpecError(f"--tree calibrate measures eagle2 and chain trees, not --method {method}'s: "
                             "drop --tree calibrate")


def check_options(args: argparse.Namespace) -> None:
    """Reject bad options before any model is loaded (loading takes seconds)."""
    from pathlib import Path

    from .spec.decode import MAX_NEW_TOKENS_LIMIT
    from .spec.verify import SamplingParams

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
    tree_from_args(args)  # a malformed --tree, whatever the method
    check_combinations(args)
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
                    draft_vocab=args.draft_vocab, quantize=args.quantize, exact=args.exact, compile=args.compile,
                    activations=args.activations,
                    ngram=args.ngram, extend=args.extend, longest=args.longest_chain)
    if engine.notice:
        print(f"note: {engine.notice}", file=sys.stderr)
    return engine


def _stream_to_terminal(engine, prompt, args) -> object:
    from .spec.decode import Finished

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
    work = ""
    if s.draft_forwards and s.target_forwards:
        work += f", {s.draft_forwards / s.target_forwards:.2f} draft forwards a step"
    if s.stage2_guessed:
        work += f", stage 2 {s.stage2_accepted}/{s.stage2_guessed} guesses accepted"
    if s.traffic is not None and engine.method != "vanilla":
        work += f", weights read a token {s.traffic:.2f}x plain decoding's"
    print(f"[{s.new_tokens} tokens in {s.total_time:.2f}s: {s.tokens_per_s:.1f} tokens/s, tau {s.tau:.2f}, "
          f"method {engine.method}{drafted}{work}, {s.finish_reason}]", file=sys.stderr)
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
    model_options(p)
    sampling_options(p)
    option_group(p, EVERYDAY).add_argument("--raw", action="store_true",
                                           help="continue the prompt as plain text, no chat template")
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
