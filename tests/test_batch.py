"""Batched speculative decoding (eaglespec.spec.batch): every sequence of a batch gets exactly the tokens of batch-1
decoding, for every method, whoever drafts, however large each tree, whoever joins or leaves; the pool's rows of
several slots go through the model together on eaglespec's CPU kernels and one slot at a time elsewhere; sampled
sequences follow the target distribution (statistical test, with the power to catch a broken acceptance rule);
slots always come back; Engine.generate_batch keeps prompt order and per-prompt seeds."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, TinyTokenizer, make_cpu_model
from test_engine import random_head
from test_sampling import PARAMS, RUNS, WorstFirstDrafter, accept_first_in_support, chi_square_p_value
from test_sampling import PROMPT as SAMPLING_PROMPT

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.drafters import Drafter
from eaglespec.errors import EagleSpecError
from eaglespec.spec.batch import BatchDecoder
from eaglespec.spec.decode import Finished, SpecDecoder, Step
from eaglespec.spec.load import LoadPolicy
from eaglespec.spec.tree import DraftTree
from eaglespec.spec.verify import SamplingParams, target_probs, verify_sample
from eaglespec.targets import fast as fast_module
from eaglespec.targets import pool as pool_module
from eaglespec.targets.fast import FastTarget
from eaglespec.targets.hf import TargetModel
from eaglespec.targets.pool import TargetPool

KERNELS = bf16gemm.available(torch.bfloat16, "cpu")
needs_kernels = pytest.mark.skipif(not KERNELS, reason="eaglespec's bfloat16 kernels need AVX-512 BF16 or AVX2 + FMA "
                                                       "and a C++ compiler")

# no prompt is a prefix of another (ScriptedOracle tells the sequences apart by their prompts); some repeat
# themselves, so prompt lookup finds chains of different lengths
PROMPTS = [[5, 17, 33, 2, 9, 40], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73], [88],
           [7, 8, 9, 7, 8, 9, 7, 8], [30, 31, 30, 31, 30]]
NEW_TOKENS = [18, 9, 24, 1, 21, 14]  # one ends at its prefill
TREE = TreeSettings(total_tokens=10, depth=4, top_k=3)


class ForwardSpy:
    """Records, for each batched forward of a pool, the rows of each slot's decode step (`calls`) and of each prompt
    piece (`pieces`: steps with `logits_rows`), and counts the forwards that ran several slots' rows together."""

    def __init__(self, pool: TargetPool, monkeypatch):
        self.calls: list[list[int]] = []
        self.pieces: list[list[int]] = []
        self.together = 0
        forward, together = pool.forward, pool_module._forward_together

        def spied_forward(steps, greedy=False):
            self.calls.append([len(s[1]) for s in steps if len(s) < 5])
            self.pieces.append([len(s[1]) for s in steps if len(s) == 5])
            return forward(steps, greedy=greedy)

        def spied_together(targets, steps, greedy):
            self.together += any(t is targets[0] for t in pool.targets)
            return together(targets, steps, greedy)

        pool.forward = spied_forward
        monkeypatch.setattr(pool_module, "_forward_together", spied_together)

    @property
    def ragged(self) -> int:
        """Forwards whose slots verified trees of different sizes."""
        return sum(len(set(c)) > 1 for c in self.calls)

    @property
    def mixed(self) -> int:
        """Forwards that read a prompt piece beside other slots' decode steps."""
        return sum(bool(c) and bool(p) for c, p in zip(self.calls, self.pieces))


def drain(batch: BatchDecoder, steps=None, streamed=None) -> tuple[dict, dict]:
    """Step `batch` to the end: each request's streamed tokens (added to `streamed`: what earlier steps streamed)
    and its `Finished` (checked to agree)."""
    streamed = {} if streamed is None else streamed
    finished: dict = {}
    while batch.busy:
        for key, event in batch.step():
            assert key not in finished, f"request {key} emitted after it finished"
            if isinstance(event, Finished):
                finished[key] = event
                assert event.tokens == streamed[key]
                assert event.stats.new_tokens == len(event.tokens)
            else:
                assert isinstance(event, Step)
                streamed.setdefault(key, []).extend(event.tokens)
        if steps is not None:
            steps.append(batch.last_report)
    return streamed, finished


def make_engine(method: str, arch: str, dtype: torch.dtype, backend: str = "auto", head_kind: str = "eagle1",
                extend: int = 0):
    model = make_cpu_model(arch).to(dtype)
    extra = {}
    if method in ("eagle2", "eagle1", "chain"):
        extra["head"] = random_head(model, head_kind).to(dtype)
    if method in ("sps", "staged"):
        extra["draft_hf_model"] = make_cpu_model(arch, seed=1, layers=2).to(dtype)
    return Engine.from_model(model, TinyTokenizer(), method=method, tree=TREE, backend=backend, extend=extend, **extra)


def batch_one(engine: Engine, prompts=PROMPTS, news=NEW_TOKENS) -> dict[int, list[int]]:
    return {i: engine.generate(p, max_new_tokens=n).tokens for i, (p, n) in enumerate(zip(prompts, news))}


def check_batched_equals_batch_one(engine: Engine, monkeypatch, slots: int = 3, prefill_chunk: int = 2):
    """Every `speculate` mode, more prompts than slots: each sequence's tokens equal batch-1 decoding's."""
    expected = batch_one(engine)
    spies = {}
    for speculate in ("always", "never", "auto"):
        batch = engine.batch_decoder(max_batch=slots, speculate=speculate, prefill_chunk=prefill_chunk)
        spies[speculate] = spy = ForwardSpy(batch.pool, monkeypatch)
        for i, (prompt, n) in enumerate(zip(PROMPTS, NEW_TOKENS)):
            batch.add(i, prompt, max_new_tokens=n)
        _, finished = drain(batch)
        assert {k: f.tokens for k, f in finished.items()} == expected, speculate
        assert sorted(batch.pool.free) == list(range(slots)) and batch.pool.in_use == 0
        assert max(len(c) for c in spy.calls) == slots  # the batch was full at times
        if speculate == "never" or engine.method == "vanilla":
            assert all(set(c) <= {1} for c in spy.calls)
        for calls, pieces in zip(spy.calls, spy.pieces):  # prompts beside decoding sequences: pieces, or whole
            if calls and batch.chunked:
                assert sum(pieces) <= prefill_chunk
            elif calls:
                assert len(pieces) <= 1
    return spies


METHODS = [("vanilla", "qwen2", "eagle1"), ("eagle2", "llama", "eagle1"), ("eagle2", "qwen2", "eagle3"),
           ("eagle1", "llama", "eagle1"), ("chain", "qwen2", "eagle1"), ("pld", "llama", "eagle1"),
           ("sps", "qwen2", "eagle1"), ("staged", "llama", "eagle1")]


@needs_kernels
@pytest.mark.parametrize("method,arch,head_kind", METHODS, ids=[f"{m}-{a}-{h}" for m, a, h in METHODS])
def test_batched_greedy_equals_batch_one_on_the_kernels(method, arch, head_kind, monkeypatch):
    engine = make_engine(method, arch, torch.bfloat16, head_kind=head_kind)
    assert isinstance(engine.target, FastTarget) and engine.target.tree_kernel
    assert TargetPool(engine.target, 2).together
    spies = check_batched_equals_batch_one(engine, monkeypatch)
    for spy in spies.values():  # several slots' rows through each layer at once, whenever several slots ran
        assert spy.together == sum(len(c) + len(p) > 1 for c, p in zip(spy.calls, spy.pieces)) > 0
        assert spy.mixed > 0  # prompts read in pieces beside the other sequences' steps
    if method == "pld":
        assert spies["always"].ragged > 0  # chains of different lengths in one forward


@pytest.mark.parametrize("method,arch", [("eagle2", "llama"), ("eagle1", "qwen2"), ("pld", "qwen2"),
                                         ("sps", "llama")])
def test_batched_greedy_equals_batch_one_slot_by_slot(method, arch, monkeypatch):
    """float32 through the generic transformers target: each slot runs its own forward."""
    engine = make_engine(method, arch, torch.float32, backend="hf")
    assert type(engine.target) is TargetModel
    assert not TargetPool(engine.target, 2).together
    spies = check_batched_equals_batch_one(engine, monkeypatch)
    assert all(spy.together == 0 for spy in spies.values())


@pytest.mark.parametrize("dtype,backend", [pytest.param(torch.bfloat16, "auto", marks=needs_kernels),
                                           (torch.float32, "hf")])
def test_batched_greedy_equals_batch_one_with_stage2_guesses(dtype, backend, monkeypatch):
    """A head's trees with the context's n-gram guesses merged in (`extend`), each slot with its own drafter: the
    same tokens as batch-1 decoding."""
    engine = make_engine("eagle2", "qwen2", dtype, backend=backend, head_kind="eagle3", extend=6)
    assert engine.drafter.extend == 6
    check_batched_equals_batch_one(engine, monkeypatch)


class ScriptedOracle(Drafter):
    """Knows each prompt's greedy continuation and proposes, under a decoy branch, a true path whose depth changes
    with the sequence and the step (0 to 4 levels, its last token wrong every third step), with path scores that
    rank the true path above the decoys: trees of many sizes, accepting many tokens, some partly."""

    name = "scripted-oracle"
    needs_features = False

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references = references

    def draft(self, tokens: torch.Tensor, new_features) -> DraftTree:
        seq = tokens.tolist()
        prompt = next(p for p in self.references if tuple(seq[: len(p)]) == p)
        done = len(seq) - len(prompt)
        turn = len(prompt) + done
        truth = list(self.references[prompt][done : done + turn % 5])
        if truth and turn % 3 == 0:
            truth[-1] = (truth[-1] + 1) % VOCAB
        toks, parents, scores = [seq[-1]], [-1], [0.0]
        parent = 0
        for level, t in enumerate(truth, 1):
            toks += [(t + 7) % VOCAB, t, (t + 9) % VOCAB]  # decoy, true child, grandchild under the decoy
            parents += [parent, parent, len(toks) - 3]
            scores += [-3.0 - level, -0.1 * level, -4.0 - level]
            parent = len(toks) - 2
        return DraftTree.from_lists(toks, parents, scores)


class Squeeze(LoadPolicy):
    """Drafts a rotating subset of the sequences and prunes each drafted tree to a size of its own."""

    def __init__(self):
        super().__init__(tree_rows=12)
        self.steps, self.sizes = 0, []

    def plan(self, keys):
        self.steps += 1
        plan = super().plan(keys)
        plan.draft = {k for k in keys if (k + self.steps) % 3}
        return plan

    def prune(self, key, tree, plan):
        size = 2 + 3 * (key % 3)
        pruned = tree.prune(size)
        self.sizes.append(len(pruned))
        return pruned


def reference_continuations(engine: Engine, prompts, n: int) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): engine.generate(p, max_new_tokens=n).tokens for p in prompts}


@pytest.mark.parametrize("dtype,backend", [pytest.param(torch.bfloat16, "auto", marks=needs_kernels),
                                           (torch.float32, "hf")], ids=["kernels", "slot-by-slot"])
@pytest.mark.parametrize("speculate", ["always", "squeeze"])
def test_oracle_trees_of_every_size_join_leave_and_cancel(dtype, backend, speculate, monkeypatch):
    """Deep acceptances of trees of different sizes, pruned differently per sequence, while requests join (more
    than the slots), finish (length, an end-of-sequence token) and are cancelled (one waiting, one running)."""
    model = make_cpu_model("qwen2", seed=3).to(dtype)
    vanilla = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend=backend)
    refs = reference_continuations(vanilla, PROMPTS, 40)
    eos = refs[tuple(PROMPTS[5])][9]  # the sixth prompt's 10th token ends it
    oracle = ScriptedOracle(refs)
    policy = Squeeze() if speculate == "squeeze" else None
    batch = BatchDecoder(TargetPool(vanilla.target, 3), TinyTokenizer(), oracle, [eos],
                         speculate="auto" if policy else "always", policy=policy)
    if isinstance(vanilla.target, FastTarget):  # slots whose caches start small and grow in batched steps
        batch.pool.targets = [vanilla.target.sibling(initial_capacity=8) for _ in range(3)]
    spy = ForwardSpy(batch.pool, monkeypatch)
    single = SpecDecoder(vanilla.target, TinyTokenizer(), oracle, eos_token_ids=[eos])
    news = [30, 12, 36, 1, 25, 30]
    expected = {}
    for i, (p, n) in enumerate(zip(PROMPTS, news)):
        *_, done = single.stream(p, max_new_tokens=n)
        expected[i] = done.tokens
        assert done.tokens == refs[tuple(p)][: len(done.tokens)]
    assert len(expected[5]) < news[5] and expected[5][-1] == eos
    for i, (p, n) in enumerate(zip(PROMPTS, news)):
        batch.add(i, p, max_new_tokens=n)
    batch.add("late", PROMPTS[2], max_new_tokens=20)
    streamed: dict = {}
    for _ in range(3):
        for key, event in batch.step():
            if isinstance(event, Step):
                streamed.setdefault(key, []).extend(event.tokens)
    assert 0 in batch.active and "late" in batch.waiting
    assert batch.cancel(0) and batch.cancel("late")
    assert not batch.cancel(0) and not batch.cancel("late") and not batch.cancel("never added")
    cancelled_prefix = streamed.pop(0)
    assert 0 < len(cancelled_prefix) < news[0] and cancelled_prefix == expected[0][: len(cancelled_prefix)]
    _, finished = drain(batch, streamed=streamed)
    assert 0 not in streamed and "late" not in streamed and set(finished) == {1, 2, 3, 4, 5}
    for key in finished:
        assert finished[key].tokens == streamed[key] == expected[key], key
    assert finished[5].stats.finish_reason == "stop" and finished[1].stats.finish_reason == "length"
    assert sorted(batch.pool.free) == [0, 1, 2] and batch.pool.in_use == 0 and not batch.busy
    assert batch.policy.outlooks == {}  # every sequence forgotten
    assert max(f.stats.tau for f in finished.values()) > (1.5 if policy else 2.0)  # deep acceptances
    assert spy.ragged > 0
    if dtype == torch.bfloat16:
        assert spy.together > 0
        assert all(t.capacity > 8 for t in batch.pool.targets)
    if policy is not None:
        assert {2, 5, 8} <= set(policy.sizes)  # trees pruned to sizes of their own
        assert any(0 < sum(n > 1 for n in c) < len(c) for c in spy.calls)  # drafting and plain ones in one step
    # the same decoder serves again from its freed slots, with a key used before
    batch.add(0, PROMPTS[0], max_new_tokens=news[0])
    _, again = drain(batch)
    assert again[0].tokens == expected[0]


@needs_kernels
@pytest.mark.parametrize("stack", [True, False], ids=["stack", "python-layers"])
@pytest.mark.parametrize("kind", ["final", "eagle3"])
def test_a_prompt_read_in_pieces_leaves_the_bits_of_one_call(kind, stack, monkeypatch):
    """On the kernels a prompt row's bits do not depend on how the prompt was cut: pieces of any size (the batch's
    chunked prefill) and FastTarget's own MAX_STEP_ROWS pieces leave the cache, the features and the next token of
    one call; with the layers in one kernel call (backends.cpu.stack) and in Python."""
    monkeypatch.setenv("EAGLESPEC_STACK", "1" if stack else "0")
    model = make_cpu_model("qwen2").to(torch.bfloat16)
    target = Engine.from_model(model, TinyTokenizer(), method="vanilla").target.sibling()
    assert (target.kernel_stack is not None) == stack
    target.feature_kind = kind
    prompt = torch.tensor(PROMPTS[2] + PROMPTS[0])  # 20 rows

    def read(cuts: list[int]) -> tuple:
        target.reset()
        features = []
        for start, end in zip([0, *cuts], [*cuts, prompt.numel()]):
            out = target.forward(prompt[start:end], logits_rows=slice(-1, None), greedy=True)
            target.commit()
            features.append(out.features)
        n = prompt.numel()
        return (out.greedy(), torch.cat(features), [k[..., :n].clone() for k in target.layer_keys],
                [v[:, :n].clone() for v in target.layer_values])

    def same(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and torch.equal(a[1], b[1]) and all(
            torch.equal(x, y) for x, y in zip(a[2] + a[3], b[2] + b[3]))

    attended_from = []  # the cached rows of each kernel attention call (0: a prompt's first rows)
    if stack:
        run = target.kernel_stack
        monkeypatch.setattr(target, "kernel_stack", lambda *a: attended_from.extend(a[5]) or run(*a))
    else:
        attend = target.kernels.attend_tree
        monkeypatch.setattr(target.kernels, "attend_tree",
                            lambda *a, **k: attended_from.append(k["c"]) or attend(*a, **k))
    whole = read([])
    assert target.tree_kernel and whole[1].shape[0] == prompt.numel() and set(attended_from) == {0}
    assert same(read([1, 2, 9]), whole) and same(read([7, 14]), whole)
    monkeypatch.setattr(fast_module, "MAX_STEP_ROWS", 6)  # one call, cut by the target itself
    calls = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    assert same(read([]), whole) and len(calls) == 1 + 4  # the call, and its four pieces


@needs_kernels
def test_cancel_in_the_middle_of_a_run_stops_the_stream():
    """Cancelling a running request while iterating `run` (between the events of one step) emits nothing more of
    it, and its slot is free at once."""
    model = make_cpu_model("llama").to(torch.bfloat16)
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    batch = engine.batch_decoder(max_batch=3, speculate="never")
    for i, p in enumerate(PROMPTS[:3]):
        batch.add(i, p, max_new_tokens=12)
    seen: dict = {}
    cancelled_at = None
    for key, event in batch.run():
        seen.setdefault(key, []).append(event)
        if cancelled_at is None and key == 0 and 1 in seen and len(batch.active) == 3:
            cancelled_at = len(seen[1])
            assert batch.cancel(1)
            assert batch.pool.in_use == 2
    assert cancelled_at is not None and len(seen[1]) == cancelled_at  # nothing of 1 after its cancel
    assert not any(isinstance(e, Finished) for e in seen[1])
    assert sorted(batch.pool.free) == [0, 1, 2]
    expected = batch_one(engine, PROMPTS[:3], [12] * 3)
    for key in (0, 2):
        assert [t for e in seen[key] if isinstance(e, Step) for t in e.tokens] == expected[key]


def test_add_rejects_duplicates_and_requests_beyond_the_context():
    model = make_cpu_model("llama", max_position_embeddings=64)
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="hf")
    batch = engine.batch_decoder(max_batch=1)
    batch.add("a", [1, 2, 3], max_new_tokens=4)
    batch.add("b", [4, 5], max_new_tokens=4)
    with pytest.raises(EagleSpecError, match="already in the batch"):
        batch.add("b", [4, 5], max_new_tokens=4)  # waiting
    batch.step()
    assert "a" in batch.active
    with pytest.raises(EagleSpecError, match="already in the batch"):
        batch.add("a", [1], max_new_tokens=4)  # running
    with pytest.raises(EagleSpecError, match="exceeds the model's context of 64"):
        batch.add("c", list(range(60)), max_new_tokens=8)
    with pytest.raises(EagleSpecError, match="prompt is empty"):
        batch.add("d", [], max_new_tokens=8)
    with pytest.raises(EagleSpecError, match="max_new_tokens"):
        batch.add("e", [1], max_new_tokens=0)
    assert set(batch.waiting) == {"b"} and set(batch.active) == {"a"}  # the rejected ones left no trace
    with pytest.raises(EagleSpecError, match="speculate"):
        engine.batch_decoder(speculate="sometimes")
    with pytest.raises(EagleSpecError, match="at least one slot"):
        TargetPool(engine.target, 0)


def test_a_failed_prefill_gives_its_slot_back(monkeypatch):
    """A prefill that raises (out of memory, say) leaves no slot taken: the server fails that request and goes on
    with every slot."""
    model = make_cpu_model("llama", max_position_embeddings=64)
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="hf")
    batch = engine.batch_decoder(max_batch=2)
    batch.add("bad", [1, 2, 3], max_new_tokens=4)

    def fail(*args, **kwargs):
        raise MemoryError("no room for the prompt")

    for target in batch.pool.targets:
        monkeypatch.setattr(target, "forward", fail)
    with pytest.raises(MemoryError):
        batch.step()
    assert batch.pool.in_use == 0 and not batch.busy
    monkeypatch.undo()
    batch.add("good", [1, 2, 3], max_new_tokens=4)
    tokens = [t for key, e in batch.run() if isinstance(e, Step) for t in e.tokens]
    assert tokens == engine.generate([1, 2, 3], max_new_tokens=4).tokens and batch.pool.in_use == 0


@pytest.mark.parametrize("dtype,backend", [pytest.param(torch.bfloat16, "auto", marks=needs_kernels),
                                           (torch.float32, "hf")], ids=["kernels", "slot-by-slot"])
def test_greedy_and_sampled_sequences_in_one_step(dtype, backend, monkeypatch):
    """A greedy sequence verified in the same forward as sampled ones (whose rows need full logits) still gets
    batch-1's greedy tokens; each sampled one, with its own seed, gets batch-1's tokens for that seed."""
    model = make_cpu_model("llama").to(dtype)
    engine = Engine.from_model(model, TinyTokenizer(), method="eagle2", head=random_head(model, "eagle1").to(dtype),
                               tree=TREE, backend=backend)
    sampled = dict(temperature=0.9, top_p=0.95, top_k=8)
    requests = [(PROMPTS[0], None), (PROMPTS[1], 11), (PROMPTS[2], 12), (PROMPTS[4], None)]
    expected = [engine.generate(p, max_new_tokens=20, **({} if s is None else dict(sampled, seed=s))).tokens
                for p, s in requests]
    batch = engine.batch_decoder(max_batch=4, speculate="always")
    spy = ForwardSpy(batch.pool, monkeypatch)
    for i, (p, s) in enumerate(requests):
        batch.add(i, p, max_new_tokens=20, sampling=SamplingParams() if s is None else SamplingParams(**sampled,
                                                                                                      seed=s))
    _, finished = drain(batch)
    assert [finished[i].tokens for i in range(4)] == expected
    assert max(len(c) for c in spy.calls) == 4
    assert expected[1] != batch_one(engine, [PROMPTS[1]], [20])[0]  # the sampled one did not decode greedily


def test_the_gpu_form_of_the_batched_forward_reads_prompts_beside_trees():
    """The batched forward a GPU runs (all slots' rows through the products together, one torch attention call per
    slot), here on a CPU in float32: one slot's prompt and another slot's draft tree in one forward give each the
    logits and features of its own forward, to float32 rounding (on a GPU nothing promises the bits)."""
    model = make_cpu_model("qwen2")
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="fast", exact=False)
    engine.target.feature_kind = "final"  # (the siblings' too) the features an EAGLE-1 head reads
    pool = TargetPool(engine.target, 2)
    assert not pool.together and not pool.chunked_prefill  # float32 on a CPU: slot by slot
    pool.together = True  # as on a GPU
    alone = [engine.target.sibling(), engine.target.sibling()]
    a, b = pool.acquire(), pool.acquire()
    pool.forward([(a, torch.tensor(PROMPTS[0]))])
    pool[a].commit()
    alone[0].forward(torch.tensor(PROMPTS[0]))
    alone[0].commit()
    tree = DraftTree.from_lists([7, 8, 9, 10], [-1, 0, 0, 1])
    c = pool[a].cache_len
    steps = [(a, tree.tokens, tree.positions(c), tree.ancestor_mask()),
             (b, torch.tensor(PROMPTS[2]), None, None, slice(-1, None))]
    together = pool.forward(steps)
    own = [alone[0].forward(tree.tokens, tree.positions(c), tree.ancestor_mask()),
           alone[1].forward(torch.tensor(PROMPTS[2]), logits_rows=slice(-1, None))]
    for got, want in zip(together, own):
        assert got.logits.shape == want.logits.shape and got.features.shape == want.features.shape
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.features, want.features, atol=1e-4, rtol=1e-4)
    assert together[1].logits.shape[0] == 1  # the prompt's last row only


@pytest.fixture(scope="module")
def sampling_target():
    """A tiny target and the exact distribution of its first three sampled tokens, computed from the very target the
    batch verifies with (its bfloat16 kernels where they run)."""
    dtype = torch.bfloat16 if KERNELS else torch.float32
    model = make_cpu_model("llama", seed=7, layers=2).to(dtype)
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    target = engine.target
    exact = {(): 1.0}
    with torch.inference_mode():
        for _ in range(3):
            nxt = {}
            for prefix, p in exact.items():
                target.reset()
                logits = target.forward(torch.tensor(SAMPLING_PROMPT + list(prefix))).logits[-1:]
                probs = target_probs(logits, PARAMS)[0]
                for tok in probs.nonzero().flatten().tolist():
                    nxt[prefix + (tok,)] = p * float(probs[tok])
            exact = nxt
    target.reset()
    return model, engine, exact


class RememberingWorstFirst(WorstFirstDrafter):
    """test_sampling's drafter, its children remembered per context (the contexts repeat across requests)."""

    def __init__(self, model):
        super().__init__(model)
        self.known: dict[tuple[int, ...], list[int]] = {}

    def _children(self, seq: list[int]) -> list[int]:
        if tuple(seq) not in self.known:
            self.known[tuple(seq)] = super()._children(seq)
        return self.known[tuple(seq)]


def batched_samples(model, engine, verifier, runs: int, slots: int = 16) -> list[tuple[int, ...]]:
    batch = BatchDecoder(TargetPool(engine.target, slots), TinyTokenizer(), RememberingWorstFirst(model), [],
                         speculate="always", sample_verifier=verifier)
    for seed in range(runs):
        batch.add(seed, SAMPLING_PROMPT, max_new_tokens=3, sampling=SamplingParams(PARAMS.temperature, PARAMS.top_p,
                                                                                   PARAMS.top_k, seed=seed))
    assert batch.pool.together == KERNELS
    widths = []
    _, finished = drain(batch, widths)
    assert max(r.sequences for r in widths) == slots and sum(r.drafted for r in widths) >= runs
    assert sorted(batch.pool.free) == list(range(slots))
    return [tuple(finished[seed].tokens) for seed in range(runs)]


def test_batched_sampling_matches_target_distribution(sampling_target):
    model, engine, exact = sampling_target
    samples = batched_samples(model, engine, verify_sample, RUNS)
    assert chi_square_p_value(samples, exact) > 1e-3
    assert len(set(samples)) > 8


def test_batched_statistical_test_catches_a_broken_acceptance_rule(sampling_target):
    model, engine, exact = sampling_target
    samples = batched_samples(model, engine, accept_first_in_support, 800)  # (p ~ 0 already at 600)
    assert chi_square_p_value(samples, exact) < 1e-3


def test_generate_batch_keeps_prompt_order_and_per_prompt_seeds():
    model = make_cpu_model("qwen2", seed=2)
    engine = Engine.from_model(model, TinyTokenizer(), method="pld", tree=TREE, backend="hf")
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[0], "7 8 9 7 8", PROMPTS[1]]
    greedy = engine.generate_batch(prompts, max_new_tokens=10, max_batch=2)
    assert [r.tokens for r in greedy] == [engine.generate(p, max_new_tokens=10).tokens for p in prompts]
    assert all(r.method == "pld" and r.stats.new_tokens == 10 for r in greedy)
    seeds = [3, 1, None, 4, 1]
    sampled = engine.generate_batch(prompts, max_new_tokens=10, temperature=1.0, seed=seeds, max_batch=3,
                                    speculate="always")  # (the drafts a sampled sequence gets change its draws)
    for prompt, seed, result in zip(prompts, seeds, sampled):
        if seed is not None:
            assert result.tokens == engine.generate(prompt, max_new_tokens=10, temperature=1.0, seed=seed).tokens
    one_seed = engine.generate_batch(prompts[:2], max_new_tokens=10, temperature=1.0, seed=5, speculate="always")
    assert [r.tokens for r in one_seed] == [engine.generate(p, max_new_tokens=10, temperature=1.0, seed=5).tokens
                                            for p in prompts[:2]]
    with pytest.raises(EagleSpecError, match="2 seeds for 5 prompts"):
        engine.generate_batch(prompts, max_new_tokens=4, seed=[1, 2])
    assert engine.generate_batch([], max_new_tokens=4) == []


# ---- the real SmolLM2-135M with its shipped head ------------------------------------------------------------------
REAL_PROMPTS = [
    "Name three colours.",
    "Explain how a hash table works and give a small Python example.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
]
REAL_NEW_TOKENS = 72


@pytest.mark.real_model
def test_real_model_generate_batch_equals_generate():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = Engine()  # every setting at its default: the shipped head, the machine's dtype and tree
        # the fourth prompt is read in pieces beside the others' steps
        batch = engine.generate_batch(REAL_PROMPTS, max_new_tokens=REAL_NEW_TOKENS, max_batch=3, prefill_chunk=8)
        single = [engine.generate(p, max_new_tokens=REAL_NEW_TOKENS) for p in REAL_PROMPTS]
    finally:
        torch.set_num_threads(before)
    for prompt, b, s in zip(REAL_PROMPTS, batch, single):
        assert b.tokens == s.tokens, prompt
        assert b.text == s.text
    assert sum(len(s.tokens) >= 64 for s in single) >= 3  # long answers
