"""The Python API: an `Engine` (target + drafter + loop) and a one-call `generate`.

    from eaglespec import Engine
    engine = Engine()                      # default model, its shipped head, EAGLE-2 tree
    result = engine.generate("Tell me about owls.", max_new_tokens=128)
    print(result.text, result.stats.tau)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .backends.cpu import kernels as cpu_kernels
from .backends.cpu.apply import check_activations, eagle_drafter
from .backends.cpu.quant import check_mode
from .drafters import (
    DRAFT_MODEL_METHODS,
    HEAD_METHODS,
    METHODS,
    Drafter,
    TreeSettings,
    VanillaDrafter,
    tree_chosen_by_run,
)
from .drafters.lookup import Stage2
from .errors import EagleSpecError
from .heads import DraftHead, check_head_fits, load_head
from .models import (
    DEFAULT_MODEL,
    default_extend,
    load_target,
    resolve_ngram,
    shipped_head_dir,
)
from .platform import parse_device, parse_dtype
from .spec.adaptive import (
    ADAPTIVE_CHAINS,
    DRAFT,
    PLAIN,
    AdaptiveDrafter,
    SwitchPolicy,
    chain_policy,
)
from .spec.batch import PREFILL_CHUNK, BatchDecoder
from .spec.decode import Finished, GenerationStats, SpecDecoder, Step
from .spec.prefix import DEFAULT_BYTES as PREFIX_CACHE_BYTES
from .spec.verify import SamplingParams
from .targets.fast import make_target
from .targets.pool import TargetPool

Prompt = str | list[dict]
MODES = {"eagle2": "dynamic", "eagle1": "static", "chain": "chain"}
DEFAULT_MAX_BATCH = 8  # sequences decoded together (Engine.batch_decoder, eaglespec serve --max-batch)


def check_extend(extend: int, method: str) -> int:
    """`extend` as given, if it applies to `method` (EAGLE heads' drafts)."""
    if extend < 0:
        raise EagleSpecError(f"extend must be 0 (no stage-2 continuation) or a positive count, got {extend}")
    if extend and method not in HEAD_METHODS:
        raise EagleSpecError(f"extend continues an EAGLE head's draft; method '{method}' has no head: drop it")
    return extend


def check_longest(longest: int | None, method: str, tree: TreeSettings | str | None) -> None:
    """`longest` applies to a draft model's chain (sps, staged) whose length is chosen each round (tree auto)."""
    if longest is None:
        return
    if method not in DRAFT_MODEL_METHODS:
        raise EagleSpecError(f"longest caps a draft model's chain (sps, staged); method '{method}' has none: drop it")
    if not tree_chosen_by_run(tree):
        raise EagleSpecError("longest caps the chain whose length tree 'auto' chooses each round; a given tree fixes "
                             "it: drop longest, or use tree 'auto'")
    if not isinstance(longest, int) or not 1 <= longest <= 1023:
        raise EagleSpecError(f"longest must be an integer between 1 and 1023, got {longest!r}")


def default_max_batch(device: torch.device) -> int:
    """Sequences `eaglespec serve` decodes together by default: 8 on a CPU (a step's products then still cost about
    what one row's do on a memory-bound model), 64 on a GPU."""
    return 64 if torch.device(device).type == "cuda" else DEFAULT_MAX_BATCH


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    stats: GenerationStats
    method: str


class Engine:
    """A target model, a drafting method and the decoding loop, ready to generate."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        head: str | Path | None = "auto",
        method: str = "eagle2",
        dtype: str | torch.dtype = "auto",
        tree: TreeSettings | str | None = "auto",
        device: str | torch.device = "auto",
        draft_model: str | None = None,
        backend: str = "auto",
        draft_vocab: int | None = None,
        adapt: bool = True,
        quantize: str | None = None,
        exact: bool | None = None,
        compile: bool = False,
        ngram: str | Path | None = "auto",
        extend: int | None = None,
        activations: str = "auto",
        longest: int | None = None,
    ):
        """`tree`: "auto" (EAGLE-2 / chain: this machine's cached calibration, else a default for its CPU class,
        refined while generating by the adaptive policy), "calibrate" (measure now, cache when undisturbed), explicit
        `TreeSettings`, or None (the defaults). `draft_vocab` (EAGLE-1 heads): size of the drafting vocabulary
        subset, None = the head's default, 0 = the full vocabulary. `dtype` "auto": bfloat16 on a GPU or a CPU with
        native bfloat16 (and with `compile` on a CPU with AVX2, where eaglespec's kernels read bfloat16 weights),
        float32 elsewhere. `adapt`: with tree="auto", switch between drafting and plain decoding during
        generation, whichever the last rounds measured faster (eaglespec.spec.adaptive; False: always draft).
        `quantize`: "int8" / "int4" weight-only target on CPU (changes the model; output stays lossless w.r.t. it).
        `exact`: verify passes bit-identical to one-token steps, so greedy output equals plain decoding's token for
        token; None (the default) = on wherever the fast path runs on a CPU (free with eaglespec's kernels, row-by-row
        attention elsewhere), off on a GPU (see `fastpath.make_target`). `device`: "auto" (the first CUDA GPU torch
        sees, else the CPU), "cpu", "cuda" or "cuda:N".
        `compile`: the target's decode steps through torch.compile (fast path; tens of seconds at start).
        `ngram` (method "staged"): a corpus n-gram model (`eaglespec train ngram`) guessing the draft model's chain
        where the context's own n-grams do not (and, with `extend`, an EAGLE draft's continuation); "auto" (the
        default): for staged the one shipped for a registry draft model (qwen2.5-coder-0.5b), none otherwise; None
        or "none": the context's n-grams alone (`models.resolve_ngram`).
        `extend` (EAGLE heads): up to this many stage-2 guesses (the context's n-grams, then `ngram`'s) added to each
        draft tree, as a chain from the root through the head's nodes they match, for the target to verify
        (eaglespec.drafters.eagle; 0: none; None: the registry model's default, 8 for qwen2.5-coder-1.5b, else 0).
        `activations`: what the target's 4-bit and 6-bit block products (a GGUF model's weights) multiply with:
        "auto" (the default) int8 inputs where eaglespec's kernels run them faster (the AVX-512 and AVX2 builds), as
        llama.cpp's do for the same file, else bfloat16; "int8" or "bfloat16" (the exact weights times the bfloat16
        activations). Each is its own arithmetic for the model, decoded losslessly
        (eaglespec.backends.cpu.apply.check_activations); `self.target.activations` is what runs.
        `longest` (sps, staged with tree "auto"): the longest chain the draft model may draft in a round, each
        round's length still chosen as it goes (drafters.chain_length); None: this CPU class's default
        (drafters.autotree.STAGED_TREES: 15 with AMX tiles, else 5)."""
        if method not in METHODS:
            raise EagleSpecError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
        if method in DRAFT_MODEL_METHODS and not draft_model:
            raise EagleSpecError(f"method '{method}' needs a smaller draft model sharing the tokenizer: pass "
                                 "--draft-model")
        device = parse_device(device)
        # (dtype auto: bfloat16 wherever eaglespec's bfloat16 kernels run)
        dtype = parse_dtype(dtype, device, bf16_kernels=cpu_kernels.available(torch.bfloat16, device))
        hf_model, tokenizer = load_target(model, dtype=dtype, device=device, one_copy=True)
        self.notice = ""
        self.ngram = resolve_ngram(ngram, method, draft_model)
        if extend is not None:
            check_extend(extend, method)
        head_module = None
        self.draft_hf_model = (load_target(draft_model, dtype=dtype, device=device, one_copy=True)[0]
                               if method in DRAFT_MODEL_METHODS else None)
        if method in HEAD_METHODS:
            head_dir = shipped_head_dir(model) if head == "auto" else (Path(head) if head else None)
            if head_dir is None:
                if head == "auto":
                    self.notice = f"no trained draft head is available for '{model}': running vanilla decoding"
                    method = "vanilla"
                else:
                    raise EagleSpecError(f"method '{method}' needs a draft head: pass --head DIR or use vanilla")
            else:
                head_module = load_head(head_dir, dtype=parse_dtype(dtype, device), device=device,
                                        draft_vocab=draft_vocab)
        if method not in HEAD_METHODS:  # (no head after all: plain decoding)
            extend = 0
        self.extend = default_extend(model) if extend is None else extend
        self._setup(hf_model, tokenizer, head_module, method, tree, head_name=str(head), backend=backend,
                    adapt=adapt, quantize=quantize, exact=exact, compile=compile, activations=activations,
                    longest=longest)

    @classmethod
    def from_model(cls, hf_model, tokenizer, head: DraftHead | None = None, method: str = "eagle2",
                   tree: TreeSettings | str | None = None, draft_hf_model=None, backend: str = "auto",
                   adapt: bool = True, quantize: str | None = None, exact: bool | None = None,
                   compile: bool = False, ngram: str | Path | None = None, extend: int = 0,
                   activations: str = "auto", longest: int | None = None) -> "Engine":
        """Wrap an already loaded transformers model (and optionally a head, or a draft model for sps).
        `tree` as for `Engine()`, but None (the fixed defaults) by default. A head on another device than the model
        is moved to the model's (in place, as `nn.Module.to` does)."""
        engine = cls.__new__(cls)
        engine.notice = ""
        if method not in METHODS:
            raise EagleSpecError(f"unknown method '{method}'; choose one of {', '.join(METHODS)}")
        if method in HEAD_METHODS and head is None:
            raise EagleSpecError(f"method '{method}' needs a draft head")
        if method in DRAFT_MODEL_METHODS and draft_hf_model is None:
            raise EagleSpecError(f"method '{method}' needs a draft model")
        engine.draft_hf_model = draft_hf_model
        engine.ngram, engine.extend = resolve_ngram(ngram, method, None), check_extend(extend, method)
        engine._setup(hf_model, tokenizer, head if method in HEAD_METHODS else None, method, tree, "the head",
                      backend, adapt, quantize, exact, compile, activations, longest)
        return engine

    def _setup(self, hf_model, tokenizer, head: DraftHead | None, method: str, tree: TreeSettings | str | None,
               head_name: str, backend: str = "auto", adapt: bool = True, quantize: str | None = None,
               exact: bool | None = None, compile: bool = False, activations: str = "auto",
               longest: int | None = None) -> None:
        if isinstance(tree, str) and tree not in ("auto", "calibrate"):
            raise EagleSpecError(f"tree must be 'auto', 'calibrate' or explicit settings, got '{tree}'")
        check_longest(longest, method, tree)
        quantize = check_mode(quantize, next(hf_model.parameters()).device)  # "none" -> None
        activations = check_activations(activations)
        feature_kind = None if head is None else ("eagle3" if head.config.kind == "eagle3" else "final")
        self.target = make_target(hf_model, feature_kind=feature_kind, backend=backend, quantize=quantize,
                                  exact=exact, compile=compile, activations=activations)
        if head is not None:
            head = head.to(self.target.device)  # a head built or loaded elsewhere drafts where the target runs
        self.tokenizer = tokenizer
        self.head = head
        self.method = method
        settings = None if isinstance(tree, str) else tree
        if method in DRAFT_MODEL_METHODS and isinstance(tree, str):  # its chain by hardware class (drafters.autotree)
            from .drafters.autotree import STAGED_TREES, cpu_class

            settings = STAGED_TREES[cpu_class(self.target)]
            if longest is not None:  # a chain of at most `longest` tokens
                settings = TreeSettings(total_tokens=longest + 1, depth=longest, top_k=1)
        # under tree auto, a draft model's chain (sps, staged) and a head's stage-2 guesses: how much each round
        # drafts, chosen as it goes (drafters.chain_length)
        dynamic = isinstance(tree, str) and (method in DRAFT_MODEL_METHODS or self.extend > 0)
        self.decoder = SpecDecoder(self.target, tokenizer,
                                   self._make_drafter(method, head, settings, head_name, dynamic))
        self.tree_choice = None
        if tree in ("auto", "calibrate") and method in ("eagle2", "chain") and head is not None:
            from .drafters.autotree import auto_tree

            choice = self.tree_choice = auto_tree(self, calibrate=tree == "calibrate")
            self.notice = "; ".join(filter(None, [self.notice, choice.summary()]))
            if adapt:
                start = DRAFT if choice.speculate else PLAIN
                self.decoder.drafter = AdaptiveDrafter(self.drafter, SwitchPolicy(start))
                self.notice += (f"; adaptive: starts {'drafting' if start == DRAFT else 'without a draft'} and "
                                "switches to whichever of drafting and plain decoding measures faster while it "
                                "generates (a fixed --tree TOTAL,DEPTH,TOP_K always drafts)")
        elif tree in ("auto", "calibrate") and adapt and method in ADAPTIVE_CHAINS:
            self.decoder.drafter = AdaptiveDrafter(self.drafter, chain_policy(method))
            self.notice = "; ".join(filter(None, [self.notice, (
                f"adaptive: {method} drafts where it measures faster than plain decoding (adapt=False: always)")]))

    def _make_drafter(self, method: str, head: DraftHead | None, tree: TreeSettings | None,
                      head_name: str, dynamic: bool = False) -> Drafter:
        if head is not None:
            check_head_fits(head, self.target, head_name)
            return eagle_drafter(head, self.target.embed_tokens, self.target.lm_head, MODES[method], tree,
                                 compile=bool(getattr(self.target, "compiled", False)),
                                 use_kernels=bool(getattr(self.target, "bf16_gemm", False)),
                                 target_logits=self.target.logits_head if getattr(self.target, "pack", False) else None,
                                 stage2=self._stage2() if self.extend else None, extend=self.extend,
                                 dynamic=dynamic)
        if method == "pld":
            from .drafters.lookup import PromptLookupDrafter

            return PromptLookupDrafter(tree)
        if method in DRAFT_MODEL_METHODS:
            from .drafters.draft_model import DraftModelDrafter
            from .drafters.staged import StagedDrafter

            # Not exact: a draft's bits change which tokens are proposed, never the output (steps on eaglespec's
            # kernels are row-invariant anyway, and then staged drafts are sps's drafts); for the same reason its
            # block products take int8 inputs wherever they run (the faster arithmetic, whatever the target's;
            # $EAGLESPEC_DRAFT_INT8=0: bfloat16), and its matrices are read as 4-bit blocks, rounded from its weights
            # where the file has none ($EAGLESPEC_DRAFT_Q4=0: as the file has them; the 0.5B draft of the 1.5B: a
            # forward 43 -> 29 ms on an AMX VM)
            draft_target = make_target(self.draft_hf_model, feature_kind=None, exact=False,
                                       activations="auto" if cpu_kernels.draft_int8() else "bfloat16",
                                       requantize=cpu_kernels.draft_q4())
            if method == "sps":
                return DraftModelDrafter(draft_target, tree, dynamic=dynamic)
            return StagedDrafter(draft_target, tree, stage2=self._stage2(), dynamic=dynamic)
        return VanillaDrafter()

    def _stage2(self) -> Stage2:
        """The second stage: the context's n-grams, then the corpus n-gram model's (`ngram`) where given."""
        from .drafters.lookup import context_lookup
        from .drafters.ngram import NgramModel, Stage2Chain

        stage2 = context_lookup()
        return Stage2Chain([stage2, NgramModel.load(self.ngram)]) if self.ngram is not None else stage2

    @property
    def drafter(self) -> Drafter:
        return self.decoder.drafter

    def encode(self, prompt: Prompt, chat: bool | None = None, system: str | None = None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages. Strings go through the chat template when
        the tokenizer has one (unless chat=False)."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EagleSpecError("the prompt is empty: give some text to continue or answer")
            if chat is False or (chat is None and not has_template):
                return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not messages:
                raise EagleSpecError("the message list is empty: give at least one message")
        if system:
            messages = [{"role": "system", "content": system}] + messages
        if not has_template:
            raise EagleSpecError("this tokenizer has no chat template: pass a plain prompt (--raw) instead of messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def stream(self, prompt: Prompt | list[int], max_new_tokens: int = 256, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
               chat: bool | None = None, system: str | None = None) -> Iterator[Step | Finished]:
        """Yield `Step`s as tokens are produced, then one `Finished` with the whole text and statistics."""
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        ids = prompt if _is_token_list(prompt) else self.encode(prompt, chat=chat, system=system)
        return self.decoder.stream(ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)

    def generate(self, prompt: Prompt | list[int], **kwargs) -> GenerationResult:
        """Generate to completion; same options as `stream`."""
        for item in self.stream(prompt, **kwargs):
            if isinstance(item, Finished):
                return GenerationResult(item.text, item.tokens, item.stats, self.method)
        raise RuntimeError("the decoding loop ended without a result")

    def batch_decoder(self, max_batch: int = DEFAULT_MAX_BATCH, speculate: str = "auto",
                      prefill_chunk: int = PREFILL_CHUNK, prefix_cache_bytes: int = PREFIX_CACHE_BYTES) -> BatchDecoder:
        """A continuous-batching decoder over this engine's model and drafting method (eaglespec.spec.batch): up to
        `max_batch` sequences decode together, each with its own draft tree or none (`speculate`: "auto" drafts
        where the measured costs say it pays at the current batch width, "always", "never"); new prompts are read
        `prefill_chunk` rows a step beside the running sequences, and a prompt starting like one read before takes
        those rows from a prefix cache of `prefix_cache_bytes` (0: none). Its KV-cache slots are allocated now; the
        weights are shared with this engine."""
        drafter = getattr(self.drafter, "inner", self.drafter)  # (the batch decides per step, not the adaptive policy)
        pool = TargetPool(self.target, max_batch)
        return BatchDecoder(pool, self.tokenizer, drafter, sorted(self.decoder.eos), speculate=speculate,
                            prefill_chunk=prefill_chunk, prefix_cache_bytes=prefix_cache_bytes)

    def generate_batch(self, prompts: list[Prompt | list[int]], max_new_tokens: int = 256, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | list[int | None] | None = None,
                       stop: list[str] | None = None, chat: bool | None = None, system: str | None = None,
                       max_batch: int = DEFAULT_MAX_BATCH, speculate: str = "auto",
                       prefill_chunk: int = PREFILL_CHUNK, progress: bool = False) -> list[GenerationResult]:
        """Generate for many prompts at once through a batch decoder (continuous batching: a finished prompt's slot
        goes to the next); results in the order of `prompts`. `seed`: one for all, or one per prompt (each
        sequence samples with its own generator). Greedy results equal `generate`'s for each prompt (see
        eaglespec.targets.pool for where that holds)."""
        seeds = seed if isinstance(seed, list) else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise EagleSpecError(f"got {len(seeds)} seeds for {len(prompts)} prompts: give one seed or one per prompt")
        batch = self.batch_decoder(min(max_batch, max(len(prompts), 1)), speculate, prefill_chunk)
        for i, (prompt, s) in enumerate(zip(prompts, seeds)):
            ids = prompt if _is_token_list(prompt) else self.encode(prompt, chat=chat, system=system)
            sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=s)
            batch.add(i, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)
        results: list[GenerationResult | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="batch", unit="prompt", disable=not progress) as bar:
            for key, item in batch.run():
                if isinstance(item, Finished):
                    results[key] = GenerationResult(item.text, item.tokens, item.stats, self.method)
                    bar.update()
        return results


def _is_token_list(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and len(prompt) > 0


def generate(prompt: Prompt, model: str = DEFAULT_MODEL, head: str | None = "auto", method: str = "eagle2",
             **kwargs) -> GenerationResult:
    """Load `model` (and its head) and generate once. For repeated calls build an `Engine` and reuse it."""
    return Engine(model=model, head=head, method=method).generate(prompt, **kwargs)
