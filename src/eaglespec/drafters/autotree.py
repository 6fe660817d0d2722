"""Hardware-aware EAGLE-2 trees (`--tree auto`): choose total_tokens, depth and top_k for the machine at hand.

Expected speed of a tree setting = E[accepted length] / (draft time + verify time). Three measurements feed it:

1. **Verify cost**: the target's forward time for n tree tokens, n = 1..64 (how it grows depends on the machine,
   the dtype and the backend). Cached per model, dtype, backend, CPU, threads and torch version.
2. **Draft cost**: the time a draft round takes: the head's catch-up over the newly committed positions and the
   root's distribution, timed right after a target forward as in decoding (the head's weights then come from
   memory, not the CPU caches), plus growing a tree `depth` levels deep expanding `top_k` nodes per level.
3. **Acceptance**: the head drafts one large tree at many positions of a few greedy continuations of
   calibration prompts, and every node is marked correct when its path equals the target's own continuation.
   Any smaller setting's accepted length is then replayed exactly from those records: the EAGLE-2 growth of a
   smaller tree only uses candidates the large one also produced, as long as the large one expanded them
   (it expands the best `CALIBRATION_TOP_K` nodes of each level; the rare miss counts as not accepted).

Acceptance depends on the head and the target, not on the machine; costs depend on both.

The model leaves out what isolated forwards do not show: the loop's own work per step, the draft head's weights
pushing the target's out of the CPU caches between forwards (the reverse, the target's pushing out the head's, is
in the draft cost), and the rows an EAGLE drafter's stage-2 guesses (`--extend`) add to each verify pass. On a
2-core CPU with an int4 target that made it expect 1.13x and get 0.96x (2026-11-22); on a 2-core Zen 5 with int8
inputs it preferred 6 tokens from the root's 4 best to the class default, which then decoded faster (2026-12-07).
So the best setting is then checked by decoding: it, the CPU class's default tree (DEFAULT_TREES) where that
differs, and plain decoding generate the same prompts through the real loop, interleaved; the faster tree is kept,
and drafting only if it measured faster than plain decoding (`TreeChoice.speculate`). This calibration (a minute
or two on a 2-core CPU) runs when asked for (`--tree calibrate`), and its choice is cached in `<cache>/trees/` only
if no other process used the CPU meanwhile (eaglespec.cpuload). `--tree auto` reads that cache and, where there is
none, starts from DEFAULT_TREES' setting for the CPU class without measuring anything; the adaptive policy
(eaglespec.spec.adaptive) then decides while generating whether drafting pays.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..cpuload import LoadMonitor
from ..platform import synchronize
from ..targets.hf import TargetModel
from .base import TreeSettings, VanillaDrafter
from .eagle import EagleDrafter

CALIBRATION_PROMPTS = (  # a mix of writing, code, arithmetic and knowledge
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and give a small Python example.",
    "A train leaves at 3 pm and travels 120 km at 80 km/h. When does it arrive? Explain step by step.",
    "What are the main causes of the French Revolution?",
)
CALIBRATION_DEPTH = 8  # the large tree the head drafts at every calibration position
CALIBRATION_TOP_K = 8
TREE_SIZES = (2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)  # total_tokens candidates (root included)
DEPTHS = tuple(range(1, CALIBRATION_DEPTH + 1))
TOP_KS = (1, 2, 3, 4, 6, 8)
VERSION = 16  # bump when the calibration changes meaning (3: bfloat16 packed, float32 attention; 4: draft time
# includes the round start, timed after a target forward; 5: --compile runs three graphs by tree size; 6: and
# compiles the head step; 7: compiled bfloat16 products through eaglespec's own kernel, per-layer caches; 8: and
# the head's, without guards on the compiled modules; 9: decode-step attention through eaglespec's kernel; 10:
# the kernel's products of 7-64 rows stream the weights once; 11: its multiply loop is chosen per machine, and is
# part of the key; 12: verify passes timed as greedy decoding runs them, with the screened LM head; 13: over real
# text, not random tokens; 14: EAGLE-1 draft rows through the kernel on AVX2 too; 15: compiled graphs keep small
# fused loops on one thread, attention reads strided queries; since then the kernels' source digest is part of the
# key, so a kernel change alone needs no bump; 16: decoding checks the CPU class's default tree beside the cost
# model's pick)


# What `--tree auto` uses before this machine is calibrated (`--tree calibrate`), by CPU class: the settings
# calibrations chose for SmolLM2-135M's shipped heads (benchmarks/README.md): on AVX-512 BF16 machines (Zen 5,
# Emerald Rapids) 4-6 tokens two levels deep; on AVX2 ones, whose wider verify passes cost more per row, the root's
# best children only. Where the AMX build runs (AMX tiles carry a verify pass's rows, docs/cpu.md), 4 tokens two
# levels deep from the root's 4 best: on a 2-vCPU Emerald Rapids VM with AMX (2026-11-28) the 1.5B's head ran 1.34x /
# 1.35x / 1.32x plain decoding at depth 2 / 3 / 4 (4 MT-bench first turns), 1.27x / 1.22x / 1.04x with 4 / 8 / 12
# tokens 4 deep, and SmolLM2-135M's shipped head, whose drafts cost more against its steps, 1.05x / 1.02x at depth 1
# / 2 and 0.90-0.97x at depth 4 (8 prompts). With int8 inputs (`--activations auto` on the AVX-512 build), whose
# verify rows cost less, `--tree calibrate` chose the AVX-512 default again for the 1.5B's seventh head on a 2-vCPU
# Zen 5 VM (2026-12-07, git 6400b6c: verify passes of 1 / 2 / 4 / 6 / 8 / 16 rows took 24.6 / 29.9 / 32.8 / 40.9 /
# 50.5 / 76.5 ms). Once the kernels' wide tiles prefetched further ahead (git b7b2adf) it chose 6 tokens two levels
# deep from the root's 4 best there, yet the default ran faster than that tree and larger ones, fixed, in one bench run
# (1.93x against 1.76x and less on 16 HumanEval tasks, 1.54x against 1.30x and less on 32 MT-bench turns;
# benchmarks/runs/2026-12-07-zen5-1.5b-prefetch-trees): each round's n-gram guesses add rows. The adaptive policy
# (eaglespec.spec.adaptive) then stops drafting while generating where it does not pay.
DEFAULT_TREES = {
    "gpu": TreeSettings(total_tokens=16, depth=5, top_k=4),
    "amx": TreeSettings(total_tokens=4, depth=2, top_k=4),
    "avx512": TreeSettings(total_tokens=4, depth=2, top_k=2),
    "avx2": TreeSettings(total_tokens=2, depth=1, top_k=8),
    "cpu": TreeSettings(total_tokens=4, depth=2, top_k=2),
}


# What `--tree auto` (and `calibrate`, which measures nothing for it) gives `staged` and `sps` (a draft model's
# tree, drafters/staged.py), by the same classes: on a CPU the draft model's bare chain (5 tokens at most), which
# measured faster than its 16-node tree on both CPU classes (Qwen2.5-Coder-1.5B with the 0.5B draft, 4 MT-bench
# first turns: 15.82 against 11.51 tokens/s on a Zen 4 VM with AVX-512 BF16, benchmarks/runs/2026-11-28-zen4-1.5b;
# 1.27x against 0.83x plain decoding on a Zen 3 VM with AVX2, 2026-11-27): a verify pass's extra rows cost more
# there than the alternatives' extra acceptance brings. On a GPU, where extra rows are nearly free, the paper's tree
# (not measured here). With the kernels' AMX build a verify pass of 16 rows costs little more than one, so the chain
# may grow to 15 tokens: on a 2-vCPU Emerald Rapids VM (4 HumanEval tasks x 128 tokens, fixed chains) staged ran
# 1.94x / 2.16x / 2.49x plain decoding with 5 / 9 / 15 tokens, but 1.03x / 0.52x on 4 MT-bench first turns with 5 /
# 15 (benchmarks/runs/2026-11-29-emerald-rapids-amx-staged/fixed-chains). `sps` takes the same chain; under
# `--tree auto` both choose each round's length up to it (drafters/chain_length.py). On a 2-vCPU Zen 5 VM with int8
# inputs, a cap of 15 instead of 5 measured no different in the same run (staged 1.009x / 1.016x, sps 1.001x / 0.987x
# on 32 HumanEval tasks / 32 MT-bench first turns, +-0.013-0.022; benchmarks/runs/2026-12-07-zen5-1.5b-longest-chain),
# so AVX-512 without AMX keeps 5.
STAGED_TREES = {
    "gpu": TreeSettings(total_tokens=16, depth=5, top_k=4),
    "amx": TreeSettings(total_tokens=16, depth=15, top_k=1),
    "avx512": TreeSettings(total_tokens=6, depth=5, top_k=1),
    "avx2": TreeSettings(total_tokens=6, depth=5, top_k=1),
    "cpu": TreeSettings(total_tokens=6, depth=5, top_k=1),
}


def cpu_class(target: TargetModel) -> str:
    """The key of DEFAULT_TREES for `target` on this machine: a CUDA GPU, or the CPU's kernel build (AMX, AVX-512,
    AVX2), else cpu."""
    return target.hardware_class()


@dataclass
class Candidates:
    """Every candidate of one large draft tree: node 0 is the root; `correct[i]` when node i's path equals the
    target's greedy continuation; `kids[i]` the children of node i, best first (empty if never expanded)."""

    parents: list[int]
    depths: list[int]
    scores: list[float]
    correct: list[bool]
    kids: list[list[int]]

    def accepted_length(self, total_tokens: int, depth: int, top_k: int) -> int:
        """Tokens one verify step would yield (accepted + bonus) with this EAGLE-2 setting."""
        frontier = self.kids[0][:top_k]
        generated = list(frontier)
        for _ in range(depth - 1):
            level = [c for f in frontier for c in self.kids[f][:top_k]]
            level.sort(key=lambda c: -self.scores[c])
            generated += level
            frontier = level[:top_k]
        kept = set(sorted(generated, key=lambda c: -self.scores[c])[: total_tokens - 1])
        best = 0
        for c in kept:
            if self.correct[c] and self.depths[c] > best and self._path_kept(c, kept):
                best = self.depths[c]
        return best + 1

    def _path_kept(self, node: int, kept: set[int]) -> bool:
        while node > 0:
            if node not in kept:
                return False
            node = self.parents[node]
        return True


@dataclass
class TreeChoice:
    settings: TreeSettings
    expected_tau: float
    expected_tokens_per_s: float
    verify_ms: dict[int, float]  # total_tokens -> ms per target forward
    draft_ms: dict[str, float]  # "depth,top_k" -> ms per drafted tree
    ranking: list[dict]  # the best settings considered, best first
    positions: int  # calibration positions the acceptance was replayed on
    measured_tokens_per_s: float | None = None  # real decoding with `settings` (check_by_decoding)
    measured_vanilla_tokens_per_s: float | None = None  # real plain decoding of the same prompts
    cached: bool = False
    source: str = "calibrated"  # or "default": DEFAULT_TREES' setting for this CPU class, nothing measured
    load: str = ""  # what the other processes did while it was measured (eaglespec.cpuload)
    hardware: str = ""  # the DEFAULT_TREES key a default was taken from
    # every tree checked by decoding, the cost model's pick first: {"total_tokens", "depth", "top_k",
    # "tokens_per_s"}; `settings` is the fastest of them
    checked: list[dict] = field(default_factory=list)

    @classmethod
    def default(cls, settings: TreeSettings, hardware: str) -> "TreeChoice":
        """An uncalibrated choice: `settings` as they are, drafting (the adaptive policy then measures)."""
        return cls(settings, 0.0, 0.0, {}, {}, [], 0, source="default", hardware=hardware)

    @property
    def vanilla_tokens_per_s(self) -> float:
        """Plain decoding's expected speed: one token per single-token forward (0 where nothing was measured)."""
        return 1000.0 / self.verify_ms[1] if 1 in self.verify_ms else 0.0

    @property
    def speculate(self) -> bool:
        """Whether the best tree beats plain decoding on this machine: measured by decoding when that was done,
        else expected from the cost model."""
        if self.source == "default":
            return True
        if self.measured_tokens_per_s is not None and self.measured_vanilla_tokens_per_s is not None:
            return self.measured_tokens_per_s > self.measured_vanilla_tokens_per_s
        return self.expected_tokens_per_s > self.vanilla_tokens_per_s

    def summary(self) -> str:
        s = self.settings
        if self.source == "default":
            return (f"tree auto: total_tokens={s.total_tokens} depth={s.depth} top_k={s.top_k} (the default for "
                    f"{self.hardware} machines, not yet calibrated on this one; `--tree calibrate` measures it once, "
                    "a minute or two)")
        text = (f"tree auto: total_tokens={s.total_tokens} depth={s.depth} top_k={s.top_k} "
                f"(expected tau {self.expected_tau:.2f}, ~{self.expected_tokens_per_s:.1f} tokens/s on this machine, "
                f"plain decoding ~{self.vanilla_tokens_per_s:.1f}")
        if self.measured_tokens_per_s is not None and self.measured_vanilla_tokens_per_s is not None:
            text += (f"; measured by decoding: {self.measured_tokens_per_s:.1f} against "
                     f"{self.measured_vanilla_tokens_per_s:.1f}")
        if self.checked and settings_of(self.checked[0]) != s:
            pick = self.checked[0]
            text += (f"; the cost model's pick, total_tokens={pick['total_tokens']} depth={pick['depth']} "
                     f"top_k={pick['top_k']}, decoded at {pick['tokens_per_s']:.1f}, so the CPU class's default "
                     "was kept")
        return text + ")"

    def to_json(self) -> dict:
        d = asdict(self)
        d["settings"] = settings_row(self.settings)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "TreeChoice":
        d = dict(d)
        d["settings"] = TreeSettings(**d["settings"])
        d["source"] = "calibrated"
        d["verify_ms"] = {int(k): v for k, v in d["verify_ms"].items()}
        d["cached"] = True
        return cls(**d)


# ---- measurements -----------------------------------------------------------------------------------------
def verify_costs(target: TargetModel, sizes=TREE_SIZES, context: int = 192, repeats: int = 5,
                 text: list[int] | None = None) -> dict[int, float]:
    """Milliseconds per target forward of n tree tokens after `context` committed tokens: {n: ms}. The sizes are
    timed in interleaved passes (median per size), so a slow spell of the machine does not bend the curve at a
    few sizes only, and the curve is made non-decreasing (a bigger tree never costs less). `text`: real token ids
    (the calibration's greedy answers, joined) for the context and the tree tokens, so that greedy decoding's
    screened LM head sees the hidden states it sees in decoding (random tokens give flat logits, which leave it
    many more candidates to score); random tokens where it is missing or too short."""
    vocab = target.vocab_size
    context = max(1, min(context, target.max_context // 2))
    sizes = sorted({s for s in set(sizes) | {1} if context + s <= target.max_context})
    ids = torch.tensor(text[: context + max(sizes)]) if text else None
    if ids is None or ids.numel() < context + max(sizes):
        ids = torch.randint(0, vocab, (context + max(sizes),))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        target.reset()
        target.forward(ids[:context])
        target.commit()
        for rep in range(repeats + 1):  # pass 0 is a warm-up
            for n in sizes:
                tokens = ids[context : context + n]
                mask = torch.ones(n, n, dtype=torch.bool).tril_()
                t0 = time.perf_counter()
                target.forward(tokens, torch.arange(context, context + n), mask, greedy=True)  # as greedy decoding
                target.commit(torch.zeros(0, dtype=torch.long))  # keep nothing: the context stays as it was
                synchronize(target.device)
                if rep:
                    times[n].append(1000 * (time.perf_counter() - t0))
    target.reset()
    out, floor = {}, 0.0
    for n in sizes:
        floor = out[n] = max(floor, statistics.median(times[n]))
    return out


def _greedy_sequences(engine, prompts, new_tokens: int, progress: bool = False) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation, prompt length) for each calibration prompt."""
    from tqdm import tqdm

    seqs = []
    for prompt in tqdm(prompts, desc="tree auto: greedy continuations", unit="prompt", disable=not progress):
        ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        room = engine.target.max_context - len(ids)
        if room < CALIBRATION_DEPTH + 2:
            continue
        result = engine.generate(ids, max_new_tokens=min(new_tokens, room))
        seqs.append((ids + list(result.tokens), len(ids)))
    return seqs


def _flush_caches(target: TargetModel, token: int) -> None:
    """One discarded one-token target forward: in decoding, every draft round starts right after a verify pass
    has streamed the target's weights through the CPU caches, so the head's weights come from memory."""
    target.forward(torch.tensor([token]))
    target.commit(torch.zeros(0, dtype=torch.long))  # keep nothing
    synchronize(target.device)


def record_candidates(drafter: EagleDrafter, target: TargetModel, sequences: list[tuple[list[int], int]],
                      stride: int = 2, depth: int = CALIBRATION_DEPTH, top_k: int = CALIBRATION_TOP_K,
                      time_settings: list[tuple[int, int]] | None = None,
                      time_rounds: int = 3, progress: bool = False) -> tuple[list[Candidates], dict[str, float]]:
    """Draft a large tree at every `stride`-th generated position; also time drafting for `time_settings`
    (depth, top_k) pairs on the first `time_rounds` positions. Returns (candidates, {"depth,top_k": ms}).

    A round's draft time is what the decoding loop spends in `Drafter.draft`: the start of the round (the head's
    catch-up over the `stride` newly committed positions and the root's distribution), timed right after a target
    forward as in decoding, plus the growth of the tree for that setting (head weights then warm)."""
    from tqdm import tqdm

    rounds: list[Candidates] = []
    start_ms: list[float] = []
    growth_ms: dict[str, list[float]] = {}
    timed = 0
    with torch.inference_mode():
        for seq, prompt_len in tqdm(sequences, desc="tree auto: drafting trees", unit="sequence", disable=not progress):
            target.reset()
            features = target.forward(torch.tensor(seq)).features  # [L, F]
            target.reset()
            drafter.reset()
            seen = 0
            for p in range(prompt_len, len(seq) - depth, stride):  # root = seq[p], truth = seq[p+1 .. p+depth]
                timing = bool(time_settings) and timed < time_rounds and seen > 0  # a catch-up of `stride` rows
                if timing:
                    _flush_caches(target, seq[p])
                t0 = time.perf_counter()
                grow = drafter.start_round(torch.tensor(seq[: p + 1]), features[seen:p])
                if timing:
                    synchronize(target.device)
                    start_ms.append(1000 * (time.perf_counter() - t0))
                seen = p
                if timing:
                    timed += 1
                    for d, k in time_settings:
                        fresh = grow.restart()
                        t0 = time.perf_counter()
                        fresh.dynamic(total_tokens=2, depth=d, top_k=k)
                        synchronize(target.device)
                        growth_ms.setdefault(f"{d},{k}", []).append(1000 * (time.perf_counter() - t0))
                    grow = grow.restart()
                grow.dynamic(total_tokens=2, depth=depth, top_k=top_k)
                rounds.append(_candidates(grow, seq[p + 1 : p + 1 + depth]))
    drafter.reset()
    target.reset()
    start = statistics.median(start_ms) if start_ms else 0.0
    return rounds, {key: start + statistics.median(v) for key, v in growth_ms.items()}


def _candidates(grow, truth: list[int]) -> Candidates:
    n = len(grow.tokens)
    kids: list[list[int]] = [[] for _ in range(n)]
    for c in range(1, n):
        kids[grow.parents[c]].append(c)  # added best first per parent (top-k order)
    correct = [True] + [False] * (n - 1)
    for c in range(1, n):  # parents precede children
        d = grow.depths[c]
        correct[c] = correct[grow.parents[c]] and d <= len(truth) and grow.tokens[c] == truth[d - 1]
    return Candidates(list(grow.parents), list(grow.depths), list(grow.scores), correct, kids)


def expected(rounds: list[Candidates], verify_ms: dict[int, float], draft_ms: dict[str, float],
             settings: TreeSettings) -> dict | None:
    """The cost model's row for one setting: its replayed tau, draft and verify ms and expected tokens/s (None
    where the calibration did not time its depth and top_k, or its tree size)."""
    t, d, k = settings.total_tokens, settings.depth, settings.top_k
    key = f"{d},{k}"
    if key not in draft_ms or t not in verify_ms:
        return None
    tau = sum(r.accepted_length(t, d, k) for r in rounds) / max(1, len(rounds))
    step_ms = draft_ms[key] + verify_ms[t]
    return {**settings_row(settings), "tau": round(tau, 3), "draft_ms": round(draft_ms[key], 2),
            "verify_ms": round(verify_ms[t], 2), "tokens_per_s": round(1000 * tau / step_ms, 2)}


def choose(rounds: list[Candidates], verify_ms: dict[int, float], draft_ms: dict[str, float],
           mode: str = "dynamic", keep: int = 12) -> TreeChoice:
    """The setting with the highest expected tokens per second."""
    rows = []
    for d in DEPTHS:
        for k in (1,) if mode == "chain" else TOP_KS:
            sizes = [d + 1] if mode == "chain" else [t for t in TREE_SIZES if t - 1 <= k + (d - 1) * k * k]
            for t in sizes:
                row = expected(rounds, verify_ms, draft_ms, TreeSettings(total_tokens=t, depth=d, top_k=k))
                if row is not None:
                    rows.append(row)
    if not rows:
        raise ValueError("no tree setting could be evaluated (empty calibration)")
    rows.sort(key=lambda r: -r["tokens_per_s"])
    best = rows[0]
    return TreeChoice(settings_of(best), best["tau"], best["tokens_per_s"], verify_ms, draft_ms, rows[:keep],
                      len(rounds))


def settings_row(settings: TreeSettings) -> dict:
    """An EAGLE-2 setting as the calibration's rows and cache name it: {"total_tokens", "depth", "top_k"}."""
    return {"total_tokens": settings.total_tokens, "depth": settings.depth, "top_k": settings.top_k}


def settings_of(row: dict) -> TreeSettings:
    """The setting a calibration row (`settings_row`, `expected`, `TreeChoice.checked`) names."""
    return TreeSettings(total_tokens=row["total_tokens"], depth=row["depth"], top_k=row["top_k"])


def class_default(target: TargetModel, mode: str) -> tuple[TreeSettings, str]:
    """(DEFAULT_TREES' setting for `target`'s CPU class as `mode` drafts it, a chain as deep for "chain"; the
    class)."""
    hardware = cpu_class(target)
    settings = DEFAULT_TREES[hardware]
    if mode == "chain":
        settings = TreeSettings(total_tokens=settings.depth + 1, depth=settings.depth, top_k=1)
    return settings, hardware


def keep_fastest(choice: TreeChoice, candidates: list[TreeSettings], rates: list[float], plain: float,
                 rounds: list[Candidates]) -> TreeChoice:
    """`choice` (the cost model's pick, `candidates[0]`) once decoding measured each candidate at `rates` tokens/s
    and plain decoding at `plain`: set to the fastest candidate (the pick where tied), with its expected figures
    from the replay, and every measurement kept in `checked`."""
    best = max(range(len(candidates)), key=lambda i: (rates[i], -i))
    choice.checked = [{**settings_row(c), "tokens_per_s": round(r, 2)} for c, r in zip(candidates, rates)]
    choice.measured_tokens_per_s, choice.measured_vanilla_tokens_per_s = rates[best], plain
    if best:
        choice.settings = candidates[best]
        row = expected(rounds, choice.verify_ms, choice.draft_ms, choice.settings)
        choice.expected_tau, choice.expected_tokens_per_s = (row["tau"], row["tokens_per_s"]) if row else (0.0, 0.0)
    return choice


# ---- caching and the entry point ----------------------------------------------------------------------------
def machine_key() -> str:
    """CPU model and instruction set (VMs of one CPU name can expose different ones), GPU, threads, torch."""
    from ..platform import cpu_flags, cpu_model

    cpu = f"{cpu_model()}|{hashlib.sha1(' '.join(sorted(cpu_flags())).encode()).hexdigest()[:8]}"
    if torch.cuda.is_available():
        cpu += "|" + torch.cuda.get_device_name()
    return f"{cpu}|{os.cpu_count()}cpu|{torch.get_num_threads()}threads|torch{torch.__version__}"


def _fingerprint(module: torch.nn.Module, layer_matrices: bool = True) -> str:
    """A cheap identity for a set of weights: every tensor's name and shape, and for the first 64 the sum of their
    first 65,536 values (so a large matrix is not read whole, nor held as float32), without a target's decoder-layer
    matrices where `layer_matrices` is False (a fast target releases those: eaglespec.targets.source)."""
    h = hashlib.sha1()
    summed = 0
    for name, t in sorted(module.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        if summed < 64 and (layer_matrices or not (t.dim() == 2 and ".layers." in f".{name}")):
            h.update(f"{float(t.flatten()[:65536].float().sum()):.6e}".encode())
            summed += 1
    return h.hexdigest()[:16]


def _target_key(target: TargetModel) -> str:
    return "|".join([str(VERSION), _fingerprint(target.model, layer_matrices=False), type(target).__name__,
                     str(target.dtype), target.backend_signature(),
                     getattr(target.config, "_name_or_path", ""), str(target.num_layers), str(target.hidden_size),
                     machine_key()])


def _digest(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:20]


def cache_path(engine, mode: str) -> Path:
    """The cached choice for this head, target and machine."""
    from ..platform import cache_root

    return cache_root() / "trees" / (
        f"{_digest(mode + '|' + _fingerprint(engine.head) + '|' + _target_key(engine.target))}.json"
    )


def _verify_cache_path(target: TargetModel) -> Path:
    from ..platform import cache_root

    path = cache_root() / "trees" / f"verify-{_digest(_target_key(target))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def cached_verify_costs(target: TargetModel, use_cache: bool = True, text: list[int] | None = None,
                        store: bool = True) -> dict[int, float]:
    """`verify_costs` (over `text`), measured once per target and machine (shared by every head of that target).
    `store`: cache a new measurement (the calibration stores it itself, only when undisturbed)."""
    path = _verify_cache_path(target)
    if use_cache and path.is_file():
        try:
            return {int(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (json.JSONDecodeError, AttributeError, ValueError):
            path.unlink(missing_ok=True)
    costs = verify_costs(target, text=text)
    if store:
        path.write_text(json.dumps(costs) + "\n")
    return costs


def check_by_decoding(engine, candidates: list[TreeSettings], prompts=CALIBRATION_PROMPTS[:2],
                      new_tokens: int = 64) -> tuple[list[float], float]:
    """(tokens/s with each of `candidates`, tokens/s of plain decoding) through the real decoding loop: one untimed
    warm-up each, then the prompts decoded every way, interleaved so a slow spell of the machine hits all. Plain
    decoding runs in a second decoder over the same target; the engine's own decoder keeps its drafter, and its
    drafter the settings it had."""
    from ..spec.decode import Finished, SpecDecoder

    drafter = engine.decoder.drafter
    before = drafter.settings
    plain = SpecDecoder(engine.target, engine.tokenizer, VanillaDrafter())
    runs = [(engine.decoder, c) for c in candidates] + [(plain, None)]
    totals = [[0, 0.0] for _ in runs]
    try:
        for timed, prompt in [(False, prompts[0])] + [(True, p) for p in prompts]:
            ids = prompt if isinstance(prompt, list) else engine.encode(prompt)
            for (decoder, settings), total in zip(runs, totals):
                if settings is not None:
                    drafter.settings = settings
                for item in decoder.stream(ids, max_new_tokens=new_tokens if timed else 8):
                    if timed and isinstance(item, Finished):
                        total[0] += item.stats.new_tokens
                        total[1] += item.stats.total_time
    finally:
        drafter.settings = before
    rates = [tokens / seconds if seconds > 0 else 0.0 for tokens, seconds in totals]
    return rates[:-1], rates[-1]


def auto_tree(engine, prompts=CALIBRATION_PROMPTS, new_tokens: int = 80, stride: int = 2,
              use_cache: bool = True, progress: bool = True, calibrate: bool = False) -> TreeChoice:
    """Set the engine's drafter to the best tree for this machine and return the choice: the cached calibration
    where there is one; else, with `calibrate`, calibrate now (cached only where no other process used the CPU
    meanwhile: such timings would mislead every later run); else DEFAULT_TREES' setting for the CPU class, with
    nothing measured (a first run starts at once)."""
    drafter = engine.drafter
    if not isinstance(drafter, EagleDrafter) or drafter.mode == "static":
        raise ValueError("tree auto applies to EAGLE-2 (dynamic) and chain drafting")
    path = cache_path(engine, drafter.mode)
    if use_cache and path.is_file() and not calibrate:
        try:
            choice = TreeChoice.from_json(json.loads(path.read_text()))
            drafter.settings = choice.settings
            return choice
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            path.unlink(missing_ok=True)  # unreadable: calibrate again
    default, hardware = class_default(engine.target, drafter.mode)
    if not calibrate:
        drafter.settings = default
        return TreeChoice.default(default, hardware)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    say(f"tree auto: calibrating the draft tree for this machine (cached in {path.parent}) ...")
    t0 = time.perf_counter()
    with LoadMonitor() as monitor:
        sequences = _greedy_sequences(engine, prompts, new_tokens, progress)
        verify_ms = cached_verify_costs(engine.target, use_cache=False, text=[t for seq, _ in sequences for t in seq],
                                        store=False)
        pairs = [(d, 1) for d in DEPTHS] if drafter.mode == "chain" else [(d, k) for d in DEPTHS for k in TOP_KS]
        rounds, draft_ms = record_candidates(drafter, engine.target, sequences, stride=stride, time_settings=pairs,
                                             progress=progress)
        choice = choose(rounds, verify_ms, draft_ms, mode=drafter.mode)
        choice.hardware = hardware
        candidates = [choice.settings] + ([default] if default != choice.settings else [])
        say("tree auto: checking the choice by decoding" + (", beside the default for this CPU class"
                                                           if len(candidates) > 1 else "") + " ...")
        rates, plain = check_by_decoding(engine, candidates, prompts=list(prompts)[:2])
        choice = keep_fastest(choice, candidates, rates, plain, rounds)
    drafter.settings = choice.settings
    reading = monitor.reading
    choice.load = reading.describe()
    if reading.disturbed:
        say(f"tree auto: not cached: {reading.describe()} while it measured, so the timings are not this machine's; "
            "calibrate again when it is quiet")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(choice.to_json(), indent=1) + "\n")
        _verify_cache_path(engine.target).write_text(json.dumps(verify_ms) + "\n")
    say(f"tree auto: calibrated in {time.perf_counter() - t0:.0f} s on {choice.positions} positions")
    return choice
