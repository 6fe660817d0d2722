"""Everything the benchmark can time, behind one interface: `BenchMethod.generate(prompt_ids, ...) -> RunOutput`.

- In-loop methods (`kind="ours"`): vanilla, eagle2, eagle1, chain, eagle3, pld, sps, staged, each an `Engine` over the
  same loaded transformers model, so only the drafter differs; and `oracle` (eaglespec.bench.oracle: drafts
  plain decoding's own answer, the ceiling of speculation here; only when asked for, not in 'all').
- Peers (`kind="peer"`): transformers `generate` (hf: plain greedy/sampling; hf-pld: prompt lookup; hf-assisted:
  a draft model) on the same model object, and llama.cpp (`llamacpp`) on the GGUF file of the same model.
- Peers in their own virtualenv and process (eaglespec.bench.peers): vLLM's CPU build (vllm, vllm-ngram, vllm-draft,
  vllm-eagle3) on the model's transformers folder in bfloat16, and OpenVINO GenAI (openvino, openvino-draft) on the
  model exported to OpenVINO.

Every method gets the same prompt token ids and returns the new token ids cut after the first end-of-sequence
token (which is counted), so token counts mean the same thing everywhere. Wall time is measured here, around the
whole call (prefill included, tokenisation excluded).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..drafters import TreeSettings, tree_chosen_by_run
from ..drafters.base import DRAFT_MODEL_METHODS
from ..errors import EagleSpecError
from ..llamacpp import LLAMA_CPP_PIP, llama_class
from ..llamacpp import installed as llamacpp_installed
from ..models import resolve_ngram
from ..spec.adaptive import ADAPTIVE_CHAINS, DRAFT, PLAIN, AdaptiveDrafter, SwitchPolicy, chain_policy
from ..targets import source
from .base import BenchMethod, LoopMethod, RunOutput, Sampling, cut_after_eos
from .oracle import OracleMethod
from .peers import PEER_PROCESS_METHODS, PeerOptions, build_peer_method, peer_unavailable

LOOP_METHODS = ("vanilla", "eagle2", "eagle1", "chain", "eagle3", "pld", "sps", "staged")
PEER_METHODS = ("hf", "hf-pld", "hf-assisted", "llamacpp") + PEER_PROCESS_METHODS
ALL_METHODS = LOOP_METHODS + PEER_METHODS  # what 'all' runs
CEILING_METHODS = ("oracle",)  # measurements, not methods: run only when named
KNOWN_METHODS = ALL_METHODS + CEILING_METHODS
TREE_KEYS = ("total_tokens", "depth", "top_k")
# Which in-loop methods a swept tree setting changes (the others run once, unswept).
SWEEP_AFFECTS = {
    "total_tokens": ("eagle2", "eagle3", "staged"),
    "depth": ("eagle2", "eagle3", "chain", "pld", "sps", "staged", "oracle"),
    "top_k": ("eagle2", "eagle3", "staged"),
    "extend": ("eagle2", "eagle3", "eagle1", "chain"),  # not a tree setting: the stage-2 guesses added to one
}
SWEEP_KEYS = (*TREE_KEYS, "extend")
# What a variant of one method (`--methods staged,staged@longest=15`) may set, and the methods each key applies to:
# the sweep's keys, and `longest`, the cap on a draft model's chain whose length tree auto chooses each round.
VARIANT_AFFECTS = {**{key: tuple(m for m in SWEEP_AFFECTS[key] if m != "oracle") for key in SWEEP_KEYS},
                   "longest": ("sps", "staged")}
CHAIN_METHODS = ("pld", "sps")  # draft min(depth, total_tokens - 1) tokens a round (staged too when top_k is 1)
HF_PLD_TOKENS = 10  # transformers' documented prompt_lookup_num_tokens example value

class HFMethod(BenchMethod):
    """transformers `generate` on the same model: plain, prompt lookup, or assisted by a draft model."""

    def __init__(self, method: str, model, eos_ids: list[int], draft_model=None):
        settings: dict = {"backend": "transformers generate"}
        if method == "hf-pld":
            settings["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
        if method == "hf-assisted":
            if draft_model is None:
                raise EagleSpecError("method 'hf-assisted' needs a draft model: pass --draft-model")
            settings["assistant"] = getattr(draft_model.config, "_name_or_path", "") or "draft model"
        parameter = next(model.parameters())
        settings.update(dtype=str(parameter.dtype).removeprefix("torch."), device=str(parameter.device))
        super().__init__(method, method, "peer", settings)
        self.model, self.draft_model, self.eos_ids = model, draft_model, sorted(eos_ids)

    def _config(self, max_new_tokens: int, sampling: Sampling):
        from transformers import GenerationConfig

        options = dict(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                       eos_token_id=self.eos_ids or None, pad_token_id=self.eos_ids[0] if self.eos_ids else 0)
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        else:
            options.update(temperature=None, top_p=None, top_k=None)
        if self.method == "hf-pld":
            options["prompt_lookup_num_tokens"] = HF_PLD_TOKENS
        return GenerationConfig(**options)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], device=device)
        config = self._config(max_new_tokens, sampling)
        extra = {"assistant_model": self.draft_model} if self.method == "hf-assisted" else {}
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
        wall = time.perf_counter() - t0
        tokens = out[0, len(prompt_ids):].tolist()
        return RunOutput(tokens=cut_after_eos(tokens, set(self.eos_ids)), wall_time=wall)


class LlamaCppMethod(BenchMethod):
    """llama.cpp through llama-cpp-python, on the GGUF file of the same model, with the same thread count."""

    def __init__(self, gguf_path: Path, threads: int, eos_ids: list[int], n_ctx: int = 4096):
        Llama = llama_class("the llamacpp peer")

        super().__init__("llamacpp", "llamacpp", "peer",
                         {"backend": "llama.cpp", "gguf": Path(gguf_path).name, "threads": threads, "n_ctx": n_ctx,
                          "device": "cpu"})  # (no layers offloaded to a GPU, whatever --device says)
        self.llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         verbose=False)
        self.eos = set(eos_ids) | {int(self.llm.token_eos())}

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        if len(prompt_ids) + max_new_tokens > self.llm.n_ctx():
            raise EagleSpecError(f"llamacpp: prompt + max_new_tokens exceeds its context of {self.llm.n_ctx()}")
        if sampling.greedy:
            options = dict(top_k=1, top_p=1.0, min_p=0.0, temp=0.0)
        else:
            options = dict(top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=0.0, temp=sampling.temperature)
            if sampling.seed is not None:
                self.llm.set_seed(sampling.seed)
        tokens: list[int] = []
        t0 = time.perf_counter()
        self.llm.reset()  # no prompt-prefix reuse between runs: every run pays its prefill, like the others
        for tok in self.llm.generate(list(prompt_ids), reset=True, repeat_penalty=1.0, **options):
            tokens.append(int(tok))
            if tok in self.eos or len(tokens) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return RunOutput(tokens=tokens, wall_time=wall)


@dataclass
class MethodContext:
    """What the methods are built from."""

    model: object  # transformers causal LM (the target)
    tokenizer: object
    model_name: str  # registry name or path (for llama.cpp's GGUF file)
    tree: TreeSettings | str  # or "auto" (calibrated per head, see eaglespec.drafters.autotree)
    head_dir: Path | None = None  # EAGLE head for eagle2 / eagle1 / chain
    head3_dir: Path | None = None  # EAGLE-3 head for eagle3
    draft_model: object | None = None  # sps, staged and hf-assisted
    ngram: str | None = "auto"  # staged (and heads' `extend`): a corpus n-gram model for the second stage (--ngram)
    extend: int = 0  # heads' methods: stage-2 guesses added to each draft tree
    longest: int | None = None  # sps and staged under tree auto: their chain's cap (None: the CPU class's)
    dtype: torch.dtype = torch.float32
    threads: int = 1
    eos_ids: list[int] = field(default_factory=list)
    backend: str = "auto"  # our loop's target backend (see eaglespec.targets.fast)
    draft_vocab: int | None = None  # EAGLE-1 head drafting subset (None = the head's default, 0 = full)
    quantize: str | None = None  # our loop's weight-only target quantization (see eaglespec.backends.cpu.quant)
    exact: bool | None = None  # verify rows bit-identical to one-token steps (None: on a CPU; fastpath.make_target)
    activations: str = "auto"  # what our target's 4-bit and 6-bit block products take (backends.cpu.apply)
    compile: bool = False  # our loop's target decode steps through torch.compile (eaglespec.backends.cpu.compiled)
    adapt: bool = False  # with tree auto: also time each tree-auto method adaptively ("<method>+adapt")
    draft_model_name: str | None = None  # registry name or path of draft_model (the peers load it themselves)
    peer: PeerOptions = field(default_factory=PeerOptions)  # the out-of-process peers (vllm*, openvino*)
    progress: bool = True  # progress bars while peers export and load


def parse_methods(text: str) -> list[str]:
    """'vanilla,eagle2' -> ['vanilla', 'eagle2']; 'all' -> every method. A name may carry settings of its own, a
    variant timed beside the method in the same run: 'staged@longest=15', 'eagle2@total_tokens=8@depth=3'
    (`split_variant`; written back in that normal form). Unknown names and settings are an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise EagleSpecError("--methods is empty: give a comma-separated list, e.g. vanilla,eagle2,pld,hf")
    if names == ["all"]:
        return list(ALL_METHODS)
    seen: list[str] = []
    for n in names:
        name = variant_name(*split_variant(n))
        if name not in seen:
            seen.append(name)
    return seen


def split_variant(name: str) -> tuple[str, dict[str, int]]:
    """'staged@longest=15' -> ('staged', {'longest': 15}); 'eagle2' -> ('eagle2', {}): a known method, and each
    KEY=VALUE after an '@' a setting of VARIANT_AFFECTS that the method takes, with an integer value (checked as a
    tree's or an extend's values are)."""
    method, *parts = [part.strip() for part in name.split("@")]
    if method not in KNOWN_METHODS:
        raise EagleSpecError(f"unknown method '{method}'; choose from {', '.join(KNOWN_METHODS)} (or 'all')")
    overrides: dict[str, int] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in VARIANT_AFFECTS:
            raise EagleSpecError(f"method variant '{name}': each setting after '@' is KEY=VALUE with KEY one of "
                                 f"{', '.join(VARIANT_AFFECTS)}, e.g. staged@longest=15; got '{part}'")
        if method not in VARIANT_AFFECTS[key]:
            takers = ", ".join(VARIANT_AFFECTS[key])
            raise EagleSpecError(f"method variant '{name}': {key} applies to {takers}, not to '{method}'")
        if key in overrides:
            raise EagleSpecError(f"method variant '{name}' sets {key} twice")
        try:
            overrides[key] = int(value)
        except ValueError:
            raise EagleSpecError(f"method variant '{name}': {key} must be an integer, got '{value.strip()}'") from None
        if key in TREE_KEYS:
            TreeSettings(**{**_tree_dict(TreeSettings()), key: overrides[key]})  # validates the range
        elif overrides[key] < (0 if key == "extend" else 1):
            raise EagleSpecError(f"method variant '{name}': {key} must be at least {0 if key == 'extend' else 1}, "
                                 f"got {overrides[key]}")
    fixed = [key for key in overrides if key in TREE_KEYS]
    if "longest" in overrides and fixed:
        raise EagleSpecError(f"method variant '{name}': longest caps the chain whose length tree auto chooses each "
                             f"round, {fixed[0]} fixes the tree: give one of them")
    return method, overrides


def variant_name(method: str, overrides: dict[str, int]) -> str:
    """The row label of `method` with `overrides` ('staged@longest=15'), as split_variant reads it."""
    return "@".join([method] + [f"{key}={value}" for key, value in overrides.items()])


def unavailable_reason(method: str, ctx: MethodContext) -> str | None:
    """Why `method` (or a variant of it) cannot run with this context, or None when it can."""
    method, overrides = split_variant(method)
    if "longest" in overrides and not tree_chosen_by_run(ctx.tree):
        return ("longest caps the chain whose length --tree auto chooses each round; a given --tree fixes it: use "
                "--tree auto, or vary depth instead")
    if method in ("eagle2", "eagle1", "chain") and ctx.head_dir is None:
        return "no EAGLE draft head (pass --head DIR, or wait for a shipped head)"
    if method == "eagle3" and ctx.head3_dir is None:
        return "no EAGLE-3 head (pass --head3 DIR)"
    if method in ("sps", "staged", "hf-assisted") and ctx.draft_model is None:
        return "no draft model (pass --draft-model)"
    if method in PEER_PROCESS_METHODS:
        return peer_unavailable(method, ctx)
    if method == "llamacpp":
        if not llamacpp_installed():
            return f"llama-cpp-python is not installed ({LLAMA_CPP_PIP})"
        if _gguf_of(ctx.model_name) is None:
            return "the model is not a GGUF file, so llama.cpp cannot load the same weights"
    return None


def _gguf_of(model_name: str) -> Path | None:
    from ..models import resolve_model

    try:
        folder, gguf = resolve_model(model_name)
    except EagleSpecError:
        return None
    return folder / gguf if gguf else None


def parse_sweep(text: str | None) -> tuple[str, list[int]] | None:
    """'total_tokens=8,16,32' -> ('total_tokens', [8, 16, 32])."""
    if not text:
        return None
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in SWEEP_KEYS:
        raise EagleSpecError(f"--sweep must look like KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}; "
                             f"got '{text}'")
    try:
        numbers = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise EagleSpecError(f"--sweep values must be integers, got '{values}'") from None
    if not numbers:
        raise EagleSpecError("--sweep needs at least one value")
    for v in numbers:
        if key == "extend":
            if v < 0:
                raise EagleSpecError(f"--sweep extend values must be 0 or more, got {v}")
        else:
            TreeSettings(**{**_tree_dict(TreeSettings()), key: v})  # validates the range
    return key, list(dict.fromkeys(numbers))


def _tree_dict(tree: TreeSettings) -> dict:
    return {k: getattr(tree, k) for k in TREE_KEYS}


def _load_head(folder: Path, dtype: torch.dtype, draft_vocab: int | None = None):
    from ..heads import load_head

    return load_head(folder, dtype=dtype, draft_vocab=draft_vocab)


def peer_model(model):
    """The model transformers' peers run: the bench's own, or a float32 copy where it is bfloat16 / float16 on a CPU
    without native bfloat16 arithmetic (there transformers computes in emulated half precision, several times slower
    than in float32, which would flatter the comparison; eaglespec's own kernels read bfloat16 there and multiply in
    float32). None passes through."""
    from ..platform import cpu_has_native_bf16

    if model is None:
        return None
    parameter = next(model.parameters())
    half = parameter.dtype in (torch.bfloat16, torch.float16)
    if parameter.device.type == "cpu" and half and not cpu_has_native_bf16():
        source.restore(model)  # (matrices a fast target released: a deep copy reads them directly)
        return copy.deepcopy(model).float()
    return model


def build_methods(names: list[str], ctx: MethodContext,
                  sweep: tuple[str, list[int]] | None = None) -> list[BenchMethod]:
    """Method objects for `names` (vanilla is always included, first: it is the speedup denominator and the
    reference output). A swept tree setting turns each method it affects into one variant per value."""
    from ..api import Engine

    names = ["vanilla"] + [n for n in names if n != "vanilla"]
    for n in names:
        reason = unavailable_reason(n, ctx)
        if reason:
            raise EagleSpecError(f"method '{n}' cannot run: {reason}")
    heads: dict[str, object] = {}
    methods: list[BenchMethod] = []
    peer_models = None  # (model, draft model) for transformers' peers, made once
    answers = {} if "oracle" in names else None  # vanilla's greedy answers, which the oracle drafts
    for label in names:
        name, overrides = split_variant(label)
        if name == "oracle":
            methods += _oracle_methods(methods[0], ctx, sweep, answers)
            continue
        if name in PEER_METHODS:
            if name == "llamacpp":
                methods.append(LlamaCppMethod(_gguf_of(ctx.model_name), ctx.threads, ctx.eos_ids))
            elif name in PEER_PROCESS_METHODS:
                methods.append(build_peer_method(name, ctx, progress=ctx.progress))
            else:
                peer_models = peer_models or (peer_model(ctx.model), peer_model(ctx.draft_model))
                methods.append(HFMethod(name, peer_models[0], ctx.eos_ids, peer_models[1]))
            continue
        head = None
        if name in ("eagle2", "eagle1", "chain", "eagle3"):
            folder = ctx.head3_dir if name == "eagle3" else ctx.head_dir
            if str(folder) not in heads:
                heads[str(folder)] = _load_head(folder, ctx.dtype, None if name == "eagle3" else ctx.draft_vocab)
            head = heads[str(folder)]
        engine_method = "eagle2" if name == "eagle3" else name
        values = sweep[1] if sweep and not overrides and name in SWEEP_AFFECTS[sweep[0]] else [None]
        for value in values:
            base = TreeSettings() if ctx.tree == "auto" else ctx.tree
            swept_extend = value is not None and sweep[0] == "extend"
            tree = (ctx.tree if value is None or swept_extend
                    else TreeSettings(**{**_tree_dict(base), sweep[0]: value}))
            extend = (value if swept_extend else ctx.extend) if head is not None else 0
            if overrides:
                tree = _variant_tree(name, overrides, ctx.tree, methods[0]) or tree
                extend = overrides.get("extend", extend)
            ngram = resolve_ngram(ctx.ngram, name, ctx.draft_model_name) if name == "staged" or extend else None
            engine = Engine.from_model(ctx.model, ctx.tokenizer, head=head, method=engine_method, tree=tree,
                                       draft_hf_model=ctx.draft_model if name in ("sps", "staged") else None,
                                       backend=ctx.backend, adapt=False, quantize=ctx.quantize,
                                       exact=ctx.exact, compile=ctx.compile,
                                       ngram=ngram, extend=extend, activations=ctx.activations,
                                       longest=(overrides.get("longest", ctx.longest)  # (tree auto's chain cap)
                                                if name in DRAFT_MODEL_METHODS and isinstance(tree, str) else None))
            settings = {"target": type(engine.target).__name__, "quantize": ctx.quantize}
            if engine.target.activations != "bfloat16":  # (what "auto" chose)
                settings["activations"] = engine.target.activations
            if extend:
                settings["extend"] = extend
            if ngram is not None:
                settings["ngram"] = str(ngram)
            if name != "vanilla":
                drafter_settings = getattr(engine.drafter, "settings", None)
                settings["tree"] = _tree_dict(drafter_settings if drafter_settings is not None else base)
                if engine.tree_choice is not None:
                    settings["tree_auto"] = {"expected_tau": engine.tree_choice.expected_tau,
                                             "expected_tokens_per_s": engine.tree_choice.expected_tokens_per_s,
                                             "expected_vanilla_tokens_per_s": round(
                                                 engine.tree_choice.vanilla_tokens_per_s, 2),
                                             "measured_tokens_per_s": engine.tree_choice.measured_tokens_per_s,
                                             "measured_vanilla_tokens_per_s":
                                                 engine.tree_choice.measured_vanilla_tokens_per_s,
                                             "checked": engine.tree_choice.checked}
            if head is not None and head.config.kind == "eagle1":
                settings["draft_vocab"] = head.draft_vocab_size
            if head is not None:
                settings["head"] = str(ctx.head3_dir if name == "eagle3" else ctx.head_dir)
                settings["head_kind"] = head.config.kind
            if name in ("sps", "staged"):
                settings["draft_model"] = (ctx.draft_model_name  # (the name given, not where the cache keeps it)
                                           or getattr(ctx.draft_model.config, "_name_or_path", "") or "draft model")
                if getattr(engine.drafter.model, "requantized", False):  # (read as 4-bit blocks: $EAGLESPEC_DRAFT_Q4)
                    settings["draft_weights"] = "4-bit blocks"
            if overrides:
                settings["variant"] = dict(overrides)
            row = label if value is None else f"{name}@{sweep[0]}={value}"
            methods.append(LoopMethod(row, name, engine, settings, None if value is None else {sweep[0]: value},
                                      record_answers=answers if name == "vanilla" else None))
            if ctx.adapt and value is None and not overrides and (engine.tree_choice is not None
                                                                  or name in ADAPTIVE_CHAINS):
                if engine.tree_choice is not None:
                    start = DRAFT if engine.tree_choice.speculate else PLAIN
                    policy = SwitchPolicy(start)
                else:  # as generate runs these methods
                    policy = chain_policy(name)
                    start = policy.chosen
                methods.append(LoopMethod(f"{name}+adapt", name, engine,
                                          {**settings, "adapt": {"start": start, "timing": policy.timing}},
                                          drafter=AdaptiveDrafter(engine.drafter, policy)))
    return methods


def _variant_tree(method: str, overrides: dict[str, int], tree: TreeSettings | str,
                  vanilla: LoopMethod) -> TreeSettings | None:
    """A variant's tree: the method's own (--tree's, or under --tree auto this CPU class's default for it,
    drafters.autotree) with the variant's tree settings, a chain's node budget following its depth; fixed, as a
    given --tree is (no calibration, adaptive switching or chain length chosen each round). None: the variant sets
    no tree setting."""
    from ..drafters.autotree import DEFAULT_TREES, STAGED_TREES, cpu_class

    given = {key: value for key, value in overrides.items() if key in TREE_KEYS}
    if not given:
        return None
    if isinstance(tree, TreeSettings):
        base = tree
    elif method in DRAFT_MODEL_METHODS:
        base = STAGED_TREES[cpu_class(vanilla.engine.target)]
    elif method == "pld":
        base = TreeSettings()  # (prompt lookup's tree under auto)
    else:
        base = DEFAULT_TREES[cpu_class(vanilla.engine.target)]
    settings = {**_tree_dict(base), **given}
    chain = method in CHAIN_METHODS or (method == "staged" and settings["top_k"] == 1)
    if chain and "total_tokens" not in given:
        settings["total_tokens"] = max(settings["total_tokens"], settings["depth"] + 1)
    return TreeSettings(**settings)


def _oracle_methods(vanilla: LoopMethod, ctx: MethodContext, sweep: tuple[str, list[int]] | None,
                    answers: dict) -> list[BenchMethod]:
    """The oracle's variants (one per swept depth), drafting in vanilla's engine: the same compiled target."""
    base = TreeSettings() if ctx.tree == "auto" else ctx.tree
    values = sweep[1] if sweep and "oracle" in SWEEP_AFFECTS[sweep[0]] else [None]
    out: list[BenchMethod] = []
    for value in values:
        tree = base if value is None else TreeSettings(**{**_tree_dict(base), sweep[0]: value})
        settings = {**vanilla.settings, "tree": {"depth": tree.depth}, "draft": "plain greedy decoding's own answer"}
        label = "oracle" if value is None else f"oracle@{sweep[0]}={value}"
        out.append(OracleMethod(label, vanilla.engine, settings, tree, answers,
                                None if value is None else {sweep[0]: value}))
    return out
