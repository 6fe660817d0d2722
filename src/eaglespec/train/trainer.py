"""The training loop (accelerate): one command on a 2-core CPU or under `accelerate launch` on several GPUs.

Output folder layout:
    OUT/head/                  the final head, published EAGLE / EAGLE-3 layout (config.json + model.safetensors)
    OUT/train_config.json      the full training configuration
    OUT/train_log.jsonl        loss per logged step;   OUT/eval.jsonl   held-out accuracy at steps 1..k
    OUT/checkpoints/step-N/    head/ + state.pt (optimizer, scheduler, RNG, step, data position) + train_config.json
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import pickle
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..errors import CheckpointError, EagleSpecError
from ..heads import (
    DraftHead,
    HeadConfig,
    build_head,
    check_head_fits,
    load_head,
    save_draft_vocab,
    save_head,
)
from ..platform import gpu_lacks_native_bf16
from ..targets import source
from ..targets.hf import TargetEnds, TargetModel
from .data import Example, encode_files, read_conversations
from .evaluate import draft_accuracy, format_accuracy, log_jsonl
from .features import CachedFeatures, OnlineFeatures, open_feature_stores
from .losses import eagle1_loss, eagle3_loss
from .vocab import coverage, select_draft_vocab, token_counts

# Settings that must not change when a run is resumed (they define the data order and the objective).
RESUME_KEYS = ("kind", "data", "eval_data", "model", "max_length", "batch_size", "seed", "eval_size",
               "draft_vocab_size", "ttt_steps", "epochs", "max_steps", "lr", "warmup_steps", "ce_vocab",
               "intermediate_size")


@dataclass
class TrainConfig:
    kind: str  # "eagle1" | "eagle3"
    data: list[str]  # ShareGPT-format .json/.jsonl files
    out: str
    model: str = "smollm2-135m"
    max_length: int = 1024  # tokens per conversation (longer ones are cut)
    max_examples: int | None = None  # use at most this many conversations (after the held-out split)
    batch_size: int = 4
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (overrides epochs)
    lr: float = 3e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    noise: float | None = None  # uniform input-feature noise; default 0.1 for EAGLE-1, 0 for EAGLE-3
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    ce_vocab: str = "full"  # EAGLE-1 soft CE over the "full" vocabulary or the "draft" subset (draft_vocab_size)
    draft_vocab_size: int = 8192  # EAGLE-3
    intermediate_size: int | None = None  # the head's MLP width; None = the target's
    ttt_steps: int | None = None  # training-time test depth; None = 7 for EAGLE-3 (the paper), 1 for EAGLE-1
    eval_steps: int = 5  # accuracy reported at steps 1..eval_steps
    eval_size: int = 32  # held-out conversations drawn from `data` (ignored with eval_data)
    eval_data: list[str] | None = None  # held-out conversations from their own files; then all of `data` trains
    eval_every: int = 200
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    cache_features: str | None = None  # folder for cached target features; None = online
    feature_dtype: str = "float32"  # what the target computes training features in (bfloat16: under autocast)
    feature_path: str = "model"  # "model": transformers' forward; "fast": the decoding fast path (see Trainer)
    activations: str = "auto"  # with feature_path "fast": its block products' inputs, as decoding's (cpu.apply)
    save_dtype: str = "float32"  # dtype of the final head's weights
    mixed_precision: str = "auto"  # auto = bf16 on GPU, none on CPU
    time_budget_min: float | None = None  # stop training (and write the head) after this many minutes
    init_head: str | None = None  # start from this head's weights (ours or official layout) instead of random ones
    reselect_vocab: bool = False  # with init_head (EAGLE-3): re-choose the draft vocabulary from this run's answers
    extra: dict = field(default_factory=dict)

    def unroll_steps(self) -> int:
        """Draft steps each training slot is unrolled over (EAGLE-1's paper objective is one step)."""
        return self.ttt_steps if self.ttt_steps is not None else (7 if self.kind == "eagle3" else 1)

    def input_noise(self) -> float:
        return self.noise if self.noise is not None else (0.1 if self.kind == "eagle1" else 0.0)


# ---- data order ------------------------------------------------------------------------------------------
def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch: shuffled, grouped by similar length (less padding), order shuffled again.
    A pure function of (lengths, batch_size, seed, epoch), so a resumed run sees the same order."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    group = batch_size * 32
    batches: list[list[int]] = []
    for g in range(0, len(order), group):
        chunk = sorted(order[g : g + group], key=lambda i: lengths[i])
        batches += [chunk[s : s + batch_size] for s in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float, time_fraction: float = 0.0) -> float:
    """Linear warmup, then cosine decay to `min_ratio` at `total` steps, or earlier when a time budget is
    `time_fraction` used up (so a run stopped by its budget still ends at the low learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def split_indices(examples: list[Example], eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic held-out split: (train indices, eval indices), each in increasing order.

    The held-out examples are the `eval_size` whose tokens hash lowest under `seed`, so the split is stable as data
    grows: examples appended to a file or added in a new one can displace a held-out example into training, but an
    example never moves the other way. A head trained on the smaller data set and continued on the larger one
    (--init-head) is therefore never scored on conversations it trained on."""
    def key(i: int) -> bytes:
        h = hashlib.sha256(seed.to_bytes(8, "little", signed=True))
        h.update(examples[i].input_ids.numpy().tobytes())
        return h.digest()

    n = len(examples)
    held = set(sorted(range(n), key=lambda i: (key(i), i))[: min(eval_size, max(0, n - 1))])
    return [i for i in range(n) if i not in held], sorted(held)


# ---- checkpoints -----------------------------------------------------------------------------------------
def latest_checkpoint(out: Path) -> Path | None:
    folders = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    folders = [f for f in folders if (f / "state.pt").is_file()]
    return folders[-1] if folders else None


def _rng_state(generator: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "noise": generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict, generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    generator.set_state(state["noise"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_state(folder: Path) -> dict:
    try:
        return torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"training state '{folder / 'state.pt'}' is corrupt or unreadable ({exc})") from exc


def float32_ends(target: TargetModel, model: torch.nn.Module) -> TargetEnds:
    """What training's inputs and labels read of the target: its embedding and LM head in float32, the checkpoint's
    own values where it stores float32 ones (`targets.source.stored_copy`), even where `model` is the bfloat16 one
    the fast path computes features with."""
    return target.ends().in_float32(lambda weight: source.stored_copy(model, weight))


# ---- the loop --------------------------------------------------------------------------------------------

def auto_mixed_precision() -> str:
    """--mixed-precision auto: "bf16" on a GPU, "fp16" on one that only emulates bfloat16 (before Ampere), "no" on
    a CPU (float32: bf16 autocast there is a choice to make per CPU, see the shipped heads' README)."""
    if not torch.cuda.is_available():
        return "no"
    return "fp16" if gpu_lacks_native_bf16() else "bf16"

class Trainer:
    def __init__(self, config: TrainConfig, hf_model, tokenizer, progress: bool = True, feature_model=None):
        """`feature_model`: with `config.feature_path == "fast"`, the model the fast path runs on (bfloat16, as
        decoding loads it: `load_target(name, dtype="bfloat16", one_copy=True)`); None = a bfloat16 copy of
        `hf_model`. The training features are then the rows a head reads when drafting from that fast target.
        `hf_model` may be that same model (what `train head --feature-path fast` passes, so the target is in memory
        once): the losses read float32 copies of its embedding and LM head (`TargetEnds.in_float32`)."""
        from accelerate import Accelerator

        if config.kind not in ("eagle1", "eagle3"):
            raise EagleSpecError(f"unknown head kind '{config.kind}' (use eagle1 or eagle3)")
        if config.batch_size < 1 or config.unroll_steps() < 1 or config.eval_steps < 1:
            raise EagleSpecError("batch size, ttt steps and eval steps must be at least 1")
        if config.ce_vocab not in ("full", "draft"):
            raise EagleSpecError(f"--ce-vocab must be full or draft, got '{config.ce_vocab}'")
        self.config = config
        self.progress = progress
        mp = auto_mixed_precision() if config.mixed_precision == "auto" else config.mixed_precision
        self.accelerator = Accelerator(mixed_precision=mp)
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.target = TargetModel(hf_model.to(self.accelerator.device),
                                  feature_kind="eagle3" if config.kind == "eagle3" else "final")
        self.ends = float32_ends(self.target, hf_model)  # what the losses read of the target
        self.feature_target = self._feature_target(hf_model, feature_model)  # what computes the features

        eval_files = config.eval_data or []
        files = encode_files(tokenizer, [read_conversations(path) for path in [*config.data, *eval_files]],
                             config.max_length)
        examples = [ex for file in files for ex in file]
        if eval_files:  # held out: every conversation of the --eval-data files; trained: all of --data
            n_train = sum(len(file) for file in files[: len(config.data)])
            train_idx, held_idx = list(range(n_train)), list(range(n_train, len(examples)))
        else:
            train_idx, held_idx = split_indices(examples, config.eval_size, config.seed)
        if config.max_examples is not None:
            train_idx = train_idx[: config.max_examples]
        if not train_idx:
            raise EagleSpecError("no training conversations left after the held-out split")
        train, held = [examples[i] for i in train_idx], [examples[i] for i in held_idx]
        self.train_examples, self.eval_examples = train, held
        self.head = self._new_head(train)  # before the feature pass: a head that does not fit fails at once
        self.train_source, self.eval_source = self._sources(files, train_idx, held_idx)
        if config.cache_features:  # every feature is on disk: the losses read only the target's two ends
            self.target, self.feature_target = self.ends, None
            gc.collect()  # (the decoder layers go once the caller drops the model too, as the CLI does)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                           weight_decay=config.weight_decay)
        self.steps_per_epoch = len(train) // (config.batch_size * self.accelerator.num_processes)
        if self.steps_per_epoch == 0:
            raise EagleSpecError(f"{len(train)} training conversations are fewer than one batch of {config.batch_size}")
        self.total_steps = config.max_steps or self.steps_per_epoch * config.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_lambda(s, config.warmup_steps, self.total_steps, config.min_lr_ratio,
                                                self._time_fraction()))
        self._budget_elapsed: float | None = None  # seconds of training so far, as all processes agree (time budget)
        self.head, self.optimizer = self.accelerator.prepare(self.head, self.optimizer)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0

    def _sources(self, files: list[list[Example]], train_idx: list[int], held_idx: list[int]):
        """Feature sources for the training and held-out examples (indices into the files' examples, in order)."""
        c = self.config
        if c.cache_features:
            if not self.accelerator.is_main_process:  # the main process computes missing features first
                self.accelerator.wait_for_everyone()
            stores = open_feature_stores(self.feature_target, files, c.cache_features, self._feature_source_name(),
                                         progress=self.progress, compute_dtype=self._feature_dtype())
            if self.accelerator.is_main_process:
                self.accelerator.wait_for_everyone()
            refs = [(store, j) for store in stores for j in range(len(store.examples))]
            return (CachedFeatures([refs[i] for i in train_idx]),
                    CachedFeatures([refs[i] for i in held_idx]) if held_idx else None)
        examples = [ex for file in files for ex in file]
        compute = self._feature_dtype()
        target = self.feature_target
        return (OnlineFeatures(target, [examples[i] for i in train_idx], compute),
                OnlineFeatures(target, [examples[i] for i in held_idx], compute) if held_idx else None)

    def _feature_target(self, hf_model, feature_model) -> TargetModel:
        """The target that computes training features: `self.target` (transformers' forward), or with
        --feature-path fast a fast target over `feature_model` (the rows drafting reads: same weights, kernels and
        bits; on a GGUF model the file's own 4-bit blocks, where transformers' forward reads their bfloat16
        rounding)."""
        c = self.config
        if c.feature_path not in ("model", "fast"):
            raise EagleSpecError(f"--feature-path must be model or fast, got '{c.feature_path}'")
        if c.feature_path == "model":
            return self.target
        if c.feature_dtype != "float32":
            raise EagleSpecError("--feature-dtype applies to --feature-path model; the fast path computes features "
                                 "as it decodes")
        from ..targets.fast import make_target

        if feature_model is None:  # a bfloat16 copy (a GGUF model keeps its file: the fast path reads its blocks)
            feature_model = copy.deepcopy(hf_model).to(torch.bfloat16)
            if source.gguf_file(hf_model) is not None:
                source.note_gguf(feature_model, source.gguf_file(hf_model))
        return make_target(feature_model.to(self.accelerator.device), self.target.feature_kind, backend="fast",
                           activations=c.activations)

    def _feature_source_name(self) -> str:
        """What names a feature store besides its examples: the model and, for the fast path, its plan's
        signature (kernels, weight format), since its rows are that plan's."""
        if self.feature_target is self.target:
            return self.config.model
        return f"{self.config.model}|fast|{self.feature_target.backend_signature()}"

    def _feature_dtype(self) -> torch.dtype | None:
        """The dtype the target computes features in, None where that is its own (always, on the fast path)."""
        if self.feature_target is not self.target:
            return None
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if self.config.feature_dtype not in names:
            raise EagleSpecError(f"--feature-dtype must be float32 or bfloat16, got '{self.config.feature_dtype}'")
        dtype = names[self.config.feature_dtype]
        return None if dtype == self.feature_target.dtype else dtype

    def _new_head(self, train: list[Example]) -> DraftHead:
        c = self.config
        if c.init_head:
            return self._initial_head(train)
        head_config = HeadConfig.for_target(
            self.target, c.kind, name=c.model,
            draft_vocab_size=min(c.draft_vocab_size, self.target.vocab_size) if c.kind == "eagle3" else None,
            **({"intermediate_size": c.intermediate_size} if c.intermediate_size else {}))
        torch.manual_seed(c.seed)
        head = build_head(head_config)
        if c.kind == "eagle3" or c.ce_vocab == "draft":  # EAGLE-1 with "draft": train over the subset it drafts from
            counts, ids = self._answer_vocab(train)
            what = "draft vocabulary" if c.kind == "eagle3" else "soft cross-entropy vocabulary"
            self.print(f"{what}: {ids.numel()} tokens cover {coverage(counts, ids):.1%} of the training answers")
            if c.kind == "eagle3":
                head.set_vocab(ids)
                self._init_from_target(head, ids)
            else:
                head.set_draft_vocab(ids)
        return head.to(self.accelerator.device).train()

    def _initial_head(self, train: list[Example]) -> DraftHead:
        """`--init-head`: continue from a trained head (new data, a fresh optimizer and learning-rate schedule).
        An EAGLE-3 head keeps its own draft vocabulary unless `reselect_vocab`; an EAGLE-1 head gets the subset of the
        new data."""
        c = self.config
        head = load_head(c.init_head)
        check_head_fits(head, self.target, f"--init-head '{c.init_head}'")
        if head.config.kind != c.kind:
            raise EagleSpecError(
                f"--init-head '{c.init_head}' is a {head.config.kind} head; pass --kind {head.config.kind}")
        if c.kind == "eagle3" and not c.reselect_vocab \
                and head.config.draft_vocab_size != min(c.draft_vocab_size, self.target.vocab_size):
            raise EagleSpecError(f"--init-head '{c.init_head}' drafts from {head.config.draft_vocab_size} tokens; "
                                 f"pass --draft-vocab-size {head.config.draft_vocab_size}, or --reselect-vocab to "
                                 f"choose {c.draft_vocab_size} from this data")
        self.print(f"starting from the weights of {c.init_head}")
        if c.kind == "eagle3" and c.reselect_vocab:
            head = self._reselect_vocab(head, train)
        if c.kind == "eagle1":
            if c.ce_vocab == "draft":
                head.set_draft_vocab(self._answer_vocab(train)[1])
            else:
                head.set_draft_vocab(None)
        return head.to(self.accelerator.device).requires_grad_(True).train()

    def _reselect_vocab(self, head: DraftHead, train: list[Example]) -> DraftHead:
        """`--reselect-vocab`: an EAGLE-3 head's draft vocabulary re-chosen from this run's answers (new data may use
        other tokens). Tokens it already drafted keep their trained LM-head rows; new ones start from the target's
        rows, scaled to the trained rows' mean norm. Every other weight is kept as it is."""
        counts, ids = self._answer_vocab(train)  # ids: [Vd'] ascending
        old_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size))  # [Vd]
        new = build_head(replace(head.config, draft_vocab_size=ids.numel()))
        vocab_keys = ("lm_head.weight", "d2t", "t2d")
        kept_state = {k: v for k, v in head.state_dict().items() if k not in vocab_keys}
        missing, unexpected = new.load_state_dict(kept_state, strict=False)
        assert not unexpected and set(missing) == set(vocab_keys), (missing, unexpected)
        new.set_vocab(ids)
        slot = torch.full((self.target.vocab_size,), -1, dtype=torch.long)
        slot[old_ids] = torch.arange(old_ids.numel())
        old_slot = slot[ids]  # [Vd'] row of each new token in the old LM head, -1 if it had none
        kept = old_slot >= 0
        with torch.no_grad():
            trained = head.lm_head.weight.float()  # [Vd, d]
            rows = self.ends.lm_head.weight.detach().float().cpu()[ids].clone()  # [Vd', d]
            if kept.any():
                scale = trained[old_slot[kept]].norm(dim=-1).mean() / rows[kept].norm(dim=-1).mean()
                rows = rows * scale
                rows[kept] = trained[old_slot[kept]]
            new.lm_head.weight.copy_(rows)
        self.print(f"draft vocabulary re-chosen: {ids.numel()} tokens cover {coverage(counts, ids):.1%} of the "
                   f"training answers (the head's {old_ids.numel()}: {coverage(counts, old_ids):.1%}); "
                   f"{int(kept.sum())} keep their trained rows")
        return new

    def _answer_vocab(self, train: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token counts of the training answers [V] and the `draft_vocab_size` most frequent ids, ascending."""
        counts = token_counts(train, self.target.vocab_size)
        return counts, select_draft_vocab(counts, min(self.config.draft_vocab_size, self.target.vocab_size))

    def _init_from_target(self, head: DraftHead, ids: torch.Tensor) -> None:
        """EAGLE-3: start the head's LM head from the target's rows for the draft vocabulary and its output norm
        from the target's final norm, so a short run need not learn a 4.7M-parameter readout from scratch."""
        with torch.no_grad():
            head.lm_head.weight.copy_(self.ends.lm_head.weight[ids.to(self.ends.device)])
            final_norm = getattr(self.target.decoder, "norm", None)
            plain = final_norm is not None and "Gemma" not in type(final_norm).__name__  # Gemma stores 1 + w
            if plain and getattr(final_norm, "weight", None) is not None \
                    and final_norm.weight.shape == head.norm.weight.shape:
                head.norm.weight.copy_(final_norm.weight)

    def _save_token_ranking(self, folder: Path) -> None:
        """EAGLE-1: rank target tokens by frequency in the training answers, so drafting can score a subset."""
        counts = token_counts(self.train_examples, self.target.vocab_size)
        size = min(self.config.draft_vocab_size, self.target.vocab_size)
        ranked = torch.sort(-counts, stable=True).indices[: max(size, min(4 * size, self.target.vocab_size))]
        save_draft_vocab(folder, ranked, size)
        self.print(f"draft vocabulary for drafting: {size} tokens cover {coverage(counts, ranked[:size]):.1%} "
                   "of the training answers (--draft-vocab to change, 0 = full)")

    def _time_fraction(self) -> float:
        """Share of --time-budget used (0 without a budget), as of the current step: the same on every process."""
        budget = self.config.time_budget_min
        elapsed = getattr(self, "_budget_elapsed", None)
        if not budget or elapsed is None:
            return 0.0
        return min(1.0, elapsed / (60 * budget))

    def _elapsed(self, started: float) -> float:
        """Seconds since this run's training started, agreed by all processes (their mean): each process reading
        its own clock would stop at a different step (the others then wait forever in the gradient all-reduce)
        and follow a different learning rate (their weights would drift apart)."""
        elapsed = time.time() - started
        if self.accelerator.num_processes > 1:
            t = torch.tensor([elapsed], dtype=torch.float64, device=self.accelerator.device)
            elapsed = float(self.accelerator.reduce(t, reduction="mean")[0])
        return elapsed

    def print(self, text: str) -> None:
        if self.accelerator.is_main_process:
            print(text, file=sys.stderr, flush=True)

    def unwrapped(self) -> DraftHead:
        return self.accelerator.unwrap_model(self.head)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return None
        folder = self.out / "checkpoints" / f"step-{self.step:07d}"
        tmp = folder.with_name(folder.name + ".tmp")
        save_head(self.unwrapped(), tmp / "head")
        torch.save({
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(self.generator),
        }, tmp / "state.pt")
        (tmp / "train_config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        if folder.exists():
            for p in sorted(folder.rglob("*"), reverse=True):
                p.unlink() if p.is_file() else p.rmdir()
            folder.rmdir()
        tmp.rename(folder)
        return folder

    def resume(self, folder: Path | None = None) -> None:
        folder = folder or latest_checkpoint(self.out)
        if folder is None:
            raise EagleSpecError(f"--resume: no checkpoint in '{self.out / 'checkpoints'}'")
        config_path = folder / "train_config.json"
        if not config_path.is_file():
            raise CheckpointError(f"'{folder}' is not a training checkpoint: train_config.json is missing")
        try:
            saved = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"'{config_path}' is not valid JSON ({exc})") from exc
        if "eval_data" not in saved and self.config.eval_size > 0 and not self.config.eval_data:
            # Checkpoints written before eval_data existed drew their held-out conversations by a shuffle that
            # changes as data grows; resuming one would train on another split.
            raise CheckpointError(f"'{folder}' was written by an older eaglespec with another held-out split; "
                                  f"continue from its head instead: --init-head {folder / 'head'}")
        defaults = {f.name: f.default for f in fields(TrainConfig)}  # checkpoints from before a key existed
        saved = {k: saved.get(k, defaults.get(k)) for k in RESUME_KEYS}
        current = asdict(self.config)
        # The unrolled depth in effect, not how it was given (None = the kind's default).
        saved["ttt_steps"] = TrainConfig(kind=saved["kind"], data=[], out="",
                                         ttt_steps=saved["ttt_steps"]).unroll_steps()
        current["ttt_steps"] = self.config.unroll_steps()
        changed = [k for k in RESUME_KEYS if saved[k] != current.get(k)]
        if changed:
            raise CheckpointError(
                f"cannot resume from '{folder}': these settings differ from the checkpoint's: {', '.join(changed)}")
        head = load_head(folder / "head", device=self.accelerator.device)
        if head.config.kind != self.config.kind:
            raise CheckpointError(f"checkpoint '{folder}' holds a {head.config.kind} head, not {self.config.kind}")
        state = read_state(folder)
        self.unwrapped().load_state_dict(head.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"], self.generator)
        self.step, self.epoch, self.batch_in_epoch = (int(state["step"]), int(state["epoch"]),
                                                      int(state["batch_in_epoch"]))
        self.print(f"resumed from {folder}: step {self.step}, epoch {self.epoch}, batch {self.batch_in_epoch}")

    # ---- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict | None:
        if self.eval_source is None or not self.accelerator.is_main_process:
            return None
        result = draft_accuracy(self.unwrapped(), self.ends, self.eval_source,
                                list(range(len(self.eval_examples))), self.config.eval_steps, self.config.batch_size)
        self.print(f"eval step {self.step}: {format_accuracy(result)}")
        log_jsonl(self.out / "eval.jsonl", {"step": self.step, **result})
        return result

    # ---- training ------------------------------------------------------------------------------------
    def loss(self, batch):
        """The training loss of `batch` (moved to the head's device) as `.total` and its named `.parts`."""
        c = self.config
        head = self.unwrapped()
        batch = batch.to(self.accelerator.device)
        if c.kind == "eagle1":
            return eagle1_loss(head, self.ends, batch, c.input_noise(), self.generator, c.feature_weight, c.ce_weight,
                               model=self.head, steps=c.unroll_steps())
        return eagle3_loss(head, self.ends, batch, c.unroll_steps(), model=self.head)

    def train(self, stop_after: int | None = None) -> DraftHead:
        """Train until total_steps (or `stop_after` more steps, for tests that simulate an interruption)."""
        from tqdm import tqdm

        c = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "train_config.json").write_text(json.dumps(asdict(c), indent=2) + "\n")
        lengths = self.train_source.lengths()
        n_proc, rank = self.accelerator.num_processes, self.accelerator.process_index
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {c.kind}", unit="step",
                   disable=not (self.progress and self.accelerator.is_main_process))
        started, done_now = time.time(), 0
        self._budget_elapsed = 0.0
        batches: list[list[int]] = []
        batches_epoch = -1
        out_of_time = False
        while self.step < self.total_steps and (stop_after is None or done_now < stop_after):
            if c.time_budget_min is not None:
                self._budget_elapsed = self._elapsed(started)
                if self._budget_elapsed > 60 * c.time_budget_min:
                    self.print(f"time budget of {c.time_budget_min} min used up at step {self.step}")
                    out_of_time = True
                    break
            if batches_epoch != self.epoch:
                batches, batches_epoch = epoch_batches(lengths, c.batch_size, c.seed, self.epoch), self.epoch
            if self.batch_in_epoch >= self.steps_per_epoch:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                continue
            indices = batches[self.batch_in_epoch * n_proc + rank]
            batch = self.train_source.batch(indices)
            with self.accelerator.autocast():
                parts = self.loss(batch)
            self.optimizer.zero_grad(set_to_none=True)
            self.accelerator.backward(parts.total)
            if c.grad_clip:
                self.accelerator.clip_grad_norm_(self.head.parameters(), c.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.batch_in_epoch += 1
            done_now += 1
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == self.total_steps:
                record = {"step": self.step, "epoch": self.epoch, "loss": float(parts.total.detach()), **parts.parts,
                          "lr": self.scheduler.get_last_lr()[0], "elapsed_s": round(time.time() - started, 1)}
                bar.set_postfix(loss=f"{record['loss']:.4f}")
                if self.accelerator.is_main_process:
                    log_jsonl(self.out / "train_log.jsonl", record)
            if c.eval_every and self.step % c.eval_every == 0:
                self.evaluate()
            if c.save_every and self.step % c.save_every == 0:
                self.save_checkpoint()
        bar.close()
        if self.step >= self.total_steps or out_of_time:
            if not (c.save_every and self.step % c.save_every == 0):
                self.save_checkpoint()
            if not (c.eval_every and self.step % c.eval_every == 0):
                self.evaluate()
            if self.accelerator.is_main_process:
                from ..platform import parse_dtype

                save_head(self.unwrapped(), self.out / "head", dtype=parse_dtype(c.save_dtype))
                if c.kind == "eagle1":
                    self._save_token_ranking(self.out / "head")
                self.print(f"head written to {self.out / 'head'}")
        return self.unwrapped()
