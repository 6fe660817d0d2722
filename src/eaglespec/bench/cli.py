"""`eaglespec bench` (run a benchmark into a folder) and `eaglespec bench report DIR` (rebuild its report)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import EagleSpecError

DEFAULT_METHODS = "all"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(subparsers, model_options, sampling_options) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmark our methods and peers on MT-bench, HumanEval or a JSONL prompt file",
        description="Time every method on the same prompts in one process; write results.jsonl, summary.md and "
                    "plots to --out. `eaglespec bench report DIR` rebuilds summary.md and plots from DIR.")
    g = p.add_argument_group("benchmark")
    g.add_argument("--dataset", default="mt-bench",
                   help="mt-bench, humaneval, or a .jsonl file with question_id, category, turns (default mt-bench)")
    g.add_argument("--methods", default=None,
                   help="comma-separated: vanilla, eagle2, eagle1, chain, eagle3, pld, sps, staged, hf, hf-pld, "
                        "hf-assisted, llamacpp, vllm, vllm-ngram, vllm-draft, vllm-eagle3, openvino, openvino-draft "
                        "(the vllm and openvino peers run from their own virtualenv: --peer-python); 'all' (default) = "
                        "every one that can run here. vanilla is always included. "
                        "oracle (not in 'all', greedy only): drafts plain decoding's own answer, the tree's DEPTH "
                        "tokens a step, every one accepted at no draft cost: the ceiling of speculation here. "
                        "A variant of one of our methods, timed beside it: METHOD@KEY=VALUE[@KEY=VALUE], KEY one of "
                        "total_tokens, depth, top_k (a fixed tree: the method's own with these numbers), extend "
                        "(the heads' stage-2 guesses) or longest (sps and staged under --tree auto: the longest "
                        "chain a round drafts), e.g. staged,staged@longest=15")
    g.add_argument("--limit", type=int, default=None, help="first N questions (after --categories and --per-category)")
    g.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    g.add_argument("--categories", type=_csv, default=None, help="comma-separated categories to keep")
    g.add_argument("--turns", type=int, default=None, help="answer only the first N turns of each question")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and method (median kept)")
    g.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per method")
    g.add_argument("--sweep", default=None,
                   help="one variant per value of a tree setting, e.g. total_tokens=8,16,32 (also depth, top_k; "
                        "the others from --tree, 16,5,4 with --tree auto), or of the heads' --extend (extend=0,8)")
    g.add_argument("--adapt", action="store_true",
                   help="with --tree auto, also time each tree-auto method (eagle2, eagle3, chain) and each chain "
                        "method (pld, sps, staged) switching between drafting and plain decoding as generate does "
                        "(rows '<method>+adapt')")
    g.add_argument("--head3", default="auto", help="EAGLE-3 head folder for the eagle3 method ('auto' = shipped)")
    g.add_argument("--out", default=None, help="output folder (default bench-DATASET-TIME)")
    g.add_argument("--force", action="store_true", help="overwrite an existing results.jsonl in --out")
    g.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out (same command, code and kind of machine): prompts "
                        "with every method recorded are kept, the rest run; for runs of hours that may stop")
    g.add_argument("--reference", default=None, metavar="DIR",
                   help="take vanilla's answers and timings from an earlier bench folder with the same prompts and "
                        "target settings instead of running vanilla again (equality is still checked; speedups then "
                        "compare runs made at different times)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    peers = p.add_argument_group("peers in their own virtualenv (vllm*, openvino*)")
    peers.add_argument("--peer-python", default=None, metavar="ENGINE=PYTHON[,...]",
                       help="the python of each peer's virtualenv, e.g. vllm=VENV/bin/python,openvino=VENV2/bin/python "
                            "(default: $EAGLESPEC_VLLM_PYTHON, $EAGLESPEC_OPENVINO_PYTHON)")
    peers.add_argument("--peer-draft-tokens", type=int, default=None, metavar="K",
                       help="tokens the speculative peers draft a step (vLLM num_speculative_tokens, OpenVINO "
                            "num_assistant_tokens; default 5, our default tree's depth)")
    peers.add_argument("--openvino-weights", default="int8", choices=["int4", "int8", "fp16", "fp32"],
                       help="weights of the OpenVINO export (optimum-cli --weight-format; cached; default int8)")
    peers.add_argument("--openvino-precision", default="f32", choices=["f32", "bf16", "f16", "default"],
                       help="OpenVINO's inference and KV-cache precision (default f32: with it, its speculative "
                            "output equals its plain output; 'default' = the plugin's own choice, e.g. a u8 KV cache)")
    model_options(p)
    sampling_options(p)
    # bench takes a list (--methods); a lone --method X is read as --methods X. 128 new tokens by default.
    p.set_defaults(func=cmd_bench, method=None, max_new_tokens=128)
    sub = p.add_subparsers(dest="bench_command")
    r = sub.add_parser("report", help="rebuild summary.md and plots of a bench folder from its results.jsonl")
    r.add_argument("dir", help="the --out folder of a bench run")
    r.add_argument("--no-plots", action="store_true")
    r.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    for path in write_report(args.dir, plots=not args.no_plots):
        print(path)
    return 0


def _check(args: argparse.Namespace) -> None:
    from ..cli import check_engine_options, check_longest_chain, tree_from_args

    for name in ("limit", "per_category", "turns", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise EagleSpecError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.warmup < 0:
        raise EagleSpecError("--warmup must be 0 or more")
    if args.max_new_tokens < 1:
        raise EagleSpecError("--max-new-tokens must be at least 1")
    if args.stop:
        raise EagleSpecError("bench does not take --stop: every method stops at end-of-sequence or the length limit")
    if args.method and args.methods:
        raise EagleSpecError("give either --methods or --method, not both")
    if args.peer_draft_tokens is not None and args.peer_draft_tokens < 1:
        raise EagleSpecError("--peer-draft-tokens must be at least 1")
    from .peers import parse_peer_python

    parse_peer_python(args.peer_python)
    from ..drafters import tree_chosen_by_run
    from .methods import parse_methods, split_variant

    names = parse_methods(args.methods or args.method or DEFAULT_METHODS)
    if "oracle" in names and args.temperature > 0:
        raise EagleSpecError("method 'oracle' needs greedy decoding: drop --temperature (it drafts plain greedy "
                             "decoding's answer)")
    tree = tree_from_args(args)
    capped = [n for n in names if "longest" in split_variant(n)[1]]
    if capped and not tree_chosen_by_run(tree):
        raise EagleSpecError(f"{capped[0]}: longest caps the chain whose length --tree auto chooses each round; "
                             f"--tree {args.tree} fixes it: use --tree auto, or vary depth instead")
    if args.adapt and tree != "auto":
        raise EagleSpecError(f"--adapt applies to --tree auto: drop --tree {args.tree}")
    if tree == "calibrate":
        # a sweep and the oracle vary or read the numbers of one tree, which calibrate leaves to each method
        if args.sweep:
            raise EagleSpecError("--sweep varies a given tree: use --tree TOTAL,DEPTH,TOP_K (or auto, for 16,5,4) "
                                 "instead of --tree calibrate")
        if "oracle" in names:
            raise EagleSpecError("method 'oracle' drafts the given tree's depth: use --tree TOTAL,DEPTH,TOP_K "
                                 "(or auto, for 16,5,4) instead of --tree calibrate")
    check_engine_options(args)
    check_longest_chain(args, any(split_variant(n)[0] in ("sps", "staged") for n in names))


def _head_dirs(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    from ..models import shipped_head_dir

    head = shipped_head_dir(args.model) if args.head == "auto" else Path(args.head)  # the model's preferred head
    head3 = shipped_head_dir(args.model, "eagle3") if args.head3 == "auto" else Path(args.head3)
    for folder, flag in ((head, "--head"), (head3, "--head3")):
        if folder is not None and not (folder / "config.json").is_file():
            raise EagleSpecError(f"{flag} '{folder}' is not a draft head folder (no config.json)")
    return head, head3


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from ..backends.cpu import kernels as cpu_kernels
    from ..cli import extend_from_args, tree_from_args
    from ..models import load_target
    from ..platform import parse_device, parse_dtype
    from ..spec.decode import eos_ids_of
    from .datasets import load_questions, select
    from .methods import (
        MethodContext,
        Sampling,
        build_methods,
        parse_methods,
        parse_sweep,
        unavailable_reason,
    )
    from .peers import PeerOptions, parse_peer_python
    from .report import write_report
    from .runner import RESULTS, BenchConfig, run_benchmark

    _check(args)
    requested = args.methods or args.method or DEFAULT_METHODS
    names = parse_methods(requested)
    sweep = parse_sweep(args.sweep)
    questions = select(load_questions(args.dataset), args.categories, args.limit, args.per_category, args.turns)
    out = Path(args.out) if args.out else Path(f"bench-{Path(args.dataset).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.resume and (args.force or not args.out):
        raise EagleSpecError("--resume continues the run in --out: name it with --out, and drop --force")
    if (out / RESULTS).exists() and not (args.force or args.resume):
        raise EagleSpecError(f"'{out / RESULTS}' exists: pick another --out, pass --resume to continue it or --force "
                             "to overwrite it")
    if args.threads:
        torch.set_num_threads(args.threads)
    tree = tree_from_args(args)
    head, head3 = _head_dirs(args)
    extend = extend_from_args(args)  # (the model's default for the heads' methods; bench.methods gives others none)

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device, bf16_kernels=cpu_kernels.available(torch.bfloat16, device))
    model, tokenizer = load_target(args.model, dtype=dtype, device=device, one_copy=True)
    draft = load_target(args.draft_model, dtype=dtype, device=device, one_copy=True)[0] if args.draft_model else None
    ctx = MethodContext(model=model, tokenizer=tokenizer, model_name=args.model, tree=tree, head_dir=head,
                        head3_dir=head3, draft_model=draft, dtype=dtype,
                        threads=torch.get_num_threads(), eos_ids=eos_ids_of(model, tokenizer),
                        backend=getattr(args, "backend", "auto"), draft_vocab=args.draft_vocab,
                        quantize=None if args.quantize == "none" else args.quantize, exact=args.exact,
                        activations=args.activations,
                        compile=args.compile, adapt=args.adapt, ngram=getattr(args, "ngram", None),
                        extend=extend, longest=args.longest_chain,
                        draft_model_name=args.draft_model, progress=not args.no_progress,
                        peer=PeerOptions(python=parse_peer_python(args.peer_python),
                                         draft_tokens=args.peer_draft_tokens, openvino_weights=args.openvino_weights,
                                         openvino_precision=args.openvino_precision))
    if requested.strip() == "all":
        skipped = [(n, unavailable_reason(n, ctx)) for n in names]
        for n, reason in skipped:
            if reason:
                print(f"note: skipping {n}: {reason}", file=sys.stderr)
        names = [n for n, reason in skipped if not reason]
    methods = build_methods(names, ctx, sweep)
    engine = methods[0].engine  # vanilla: its tokenizer handling turns chat messages into prompt ids
    has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(messages: list[dict]) -> list[int]:
        if has_template:
            return engine.encode(messages)
        return engine.encode("\n\n".join(m["content"] for m in messages), chat=False)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    config = BenchConfig(
        dataset=args.dataset, max_new_tokens=args.max_new_tokens,
        sampling=Sampling(args.temperature, args.top_p, args.top_k, args.seed), repeats=args.repeats,
        warmup=args.warmup, system=args.system,
        settings={"model": args.model, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                  "threads": torch.get_num_threads(),
                  "backend": getattr(args, "backend", "auto"), "quantize": args.quantize, "exact": args.exact,
                  # what our target's block products took: --activations auto resolved on this machine
                  "activations": engine.target.activations,
                  "compile": args.compile, "adapt": args.adapt,
                  "tree": tree if isinstance(tree, str) else {"total_tokens": tree.total_tokens,
                                                              "depth": tree.depth, "top_k": tree.top_k},
                  "draft_vocab": args.draft_vocab, "ngram": getattr(args, "ngram", None),
                  "extend": extend,
                  "sweep": args.sweep, "head": str(head) if head else None, "head3": str(head3) if head3 else None,
                  "draft_model": args.draft_model, "categories": args.categories, "limit": args.limit,
                  "per_category": args.per_category, "turns": args.turns,
                  # the bfloat16 kernel's build and multiply loop on this machine, where our target runs on the kernel
                  "bf16_kernel": (f"{cpu_kernels.isa().name} {cpu_kernels.variant()}"
                                  if getattr(engine.target, "bf16_gemm", False) else None),
                  # layer matrices read as exact 4-bit blocks (eaglespec.backends.cpu.q4), of 4 per layer
                  "q4_matrices": getattr(engine.target, "q4_matrices", 0),
                  # and as exact 6-bit codes (eaglespec.backends.cpu.q6: Q6_K, Q5_0)
                  "q6_matrices": getattr(engine.target, "q6_matrices", 0)},
    )
    print(f"bench: {len(questions)} questions, methods {', '.join(m.name for m in methods)} -> {out}",
          file=sys.stderr)
    print(f"bench: device {device}, dtype {config.settings['dtype']}, {torch.get_num_threads()} torch threads, "
          f"backend {config.settings['backend']}, quantize {args.quantize}, "
          f"activations {config.settings['activations']}, "
          f"compile {args.compile}, bfloat16 kernel "
          f"{config.settings['bf16_kernel'] or '-'}, layer matrices as exact 4-bit blocks "
          f"{config.settings['q4_matrices']}, as 6-bit codes {config.settings['q6_matrices']} (our loop; peers run "
          "their own weights)",
          file=sys.stderr)
    for m in methods:
        if "tree" in m.settings:
            print(f"bench: {m.name} tree {m.settings['tree']}", file=sys.stderr)
    run_benchmark(methods, questions, encode, decode, config, out, progress=not args.no_progress,
                  command=["eaglespec"] + sys.argv[1:], reference=args.reference, resume=args.resume)
    for path in write_report(out):
        print(path)
    return 0
