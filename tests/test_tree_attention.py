"""eaglespec's decode-step attention (csrc/common/tree_attention.h): torch's attention values over the tree's visible
keys, the same bits for a tree row as for the one-token step over its path, clear errors; and a compiled bfloat16
target whose verified tree rows give the bits of plain decoding's steps, so speculative decoding reproduces plain
decoding token for token in bfloat16 too. Run on the build this CPU loads (AVX-512 or AVX2, `bf16gemm.isa()`);
skipped where it has neither or no C++ compiler exists."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyTokenizer, make_cpu_model
from test_engine import PROMPTS, random_head
from test_fastpath import PROMPT, TREE

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.spec.tree import DraftTree
from eaglespec.targets.fast import FastTarget

pytestmark = [
    pytest.mark.skipif(not bf16gemm.cpu_supported(), reason="this CPU has neither AVX-512 BF16 nor AVX2 + FMA"),
    pytest.mark.skipif(not bf16gemm.can_build(), reason="building the kernels needs a C++ compiler and ninja"),
]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    bf16gemm.load()


def cache(kv_heads, rows, hd, seed):
    g = torch.Generator().manual_seed(seed)
    capacity = rows + 5  # a longer cache than the step sees, as FastTarget's
    return (torch.randn(kv_heads, capacity, hd, generator=g), torch.randn(kv_heads, capacity, hd, generator=g))


def attend(q, keys, values, end, step_mask):
    """The kernel over cache rows [0, end): keys go in transposed, [Hkv, hd, capacity], as FastTarget keeps them."""
    keys_t = keys.transpose(1, 2).contiguous()
    return torch.ops.eaglespec.tree_attention(q, keys_t[:, :, :end], values[:, :end], step_mask)


def random_tree(n, seed):
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents))


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 4, 16), (4, 2, 128), (2, 1, 256)])
@pytest.mark.parametrize("c", [0, 1, 37, 300])
def test_matches_torch_attention_over_the_visible_keys(heads, kv_heads, hd, c):
    n = len(TREE)
    keys, values = cache(kv_heads, c + n, hd, seed=c + hd)
    q = torch.randn(heads, n, hd)
    tree = TREE.ancestor_mask()  # [n, n]
    for step_mask in (tree, None):  # None: causal
        out = attend(q, keys, values, c + n, step_mask)
        visible = torch.ones(n, c + n, dtype=torch.bool)
        visible[:, c:] = tree if step_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        expected = F.scaled_dot_product_attention(q[None], keys[None, :, : c + n], values[None, :, : c + n],
                                                  attn_mask=visible[None, None], enable_gqa=heads != kv_heads)[0]
        assert out.shape == (heads, n, hd) and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("c,tree", [(0, TREE), (5, TREE), (130, TREE), (70, random_tree(23, 1)),
                                    (300, random_tree(64, 2))])
def test_a_tree_row_has_the_bits_of_the_one_token_step_over_its_path(c, tree):
    """Row i of a verify pass sees the prefix and its path; plain decoding reaches the same token with that path
    committed in order after the prefix. Both calls must give the same bits (also for trees whose rows the kernel
    splits over several tasks and key blocks)."""
    heads, kv_heads, hd, n = 9, 3, 64, len(tree)
    keys, values = cache(kv_heads, c + n, hd, seed=c)
    q = torch.randn(heads, n, hd).bfloat16().float()  # (the model's queries are bfloat16 values)
    tree_out = attend(q, keys, values, c + n, tree.ancestor_mask())
    for row in range(n):
        path = tree.path(row)
        line_keys, line_values = keys.clone(), values.clone()
        line_keys[:, c : c + len(path)] = keys[:, [c + p for p in path]]
        line_values[:, c : c + len(path)] = values[:, [c + p for p in path]]
        one = attend(q[:, row : row + 1], line_keys, line_values, c + len(path), None)
        assert torch.equal(one[:, 0], tree_out[:, row]), f"row {row} (path {path})"


def test_a_bfloat16_cache_gives_the_bits_of_its_float32_copy():
    """The kernel widens bfloat16 keys and values exactly: a bfloat16 cache (a bfloat16 target's under --compile)
    gives the same output as the same values held in float32."""
    keys, values = (t.bfloat16() for t in cache(3, 60 + len(TREE), 64, seed=3))
    q = torch.randn(9, len(TREE), 64)
    end = 60 + len(TREE)
    half = attend(q, keys, values, end, TREE.ancestor_mask())
    full = attend(q, keys.float(), values.float(), end, TREE.ancestor_mask())
    assert torch.equal(half, full)


def test_queries_are_read_through_their_strides():
    """The compiled graphs hand over queries as a view of [n, H, hd] (the kernel reads them in place, no copy);
    a view with a strided last dim is copied first. Every layout gives the contiguous queries' bits."""
    n = len(TREE)
    keys, values = cache(3, 40 + n, 64, seed=5)
    rows_first = torch.randn(n, 9, 64)  # [n, H, hd]
    expected = attend(rows_first.transpose(0, 1).contiguous(), keys, values, 40 + n, TREE.ancestor_mask())
    wide = torch.randn(9, n, 128)
    wide[:, :, ::2] = rows_first.transpose(0, 1)
    for q in (rows_first.transpose(0, 1), wide[:, :, ::2]):
        assert not q.is_contiguous()
        assert torch.equal(attend(q, keys, values, 40 + n, TREE.ancestor_mask()), expected)


def test_bad_input_is_a_clear_error():
    keys, values = cache(2, 8, 16, seed=0)
    keys = keys[:, :8].transpose(1, 2).contiguous()  # [2, 16, 8]: 8 keys, transposed
    values = values[:, :8]
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.eaglespec.tree_attention(torch.randn(4, 2, 8), keys[:, :8], values[..., :8], None)
    with pytest.raises(RuntimeError, match=r"keys_t must be \[2, 16, c \+ 2\]"):
        torch.ops.eaglespec.tree_attention(torch.randn(4, 2, 16), keys.transpose(1, 2), values, None)
    with pytest.raises(RuntimeError, match=r"step_mask must be \[n, n\]"):
        torch.ops.eaglespec.tree_attention(torch.randn(4, 2, 16), keys, values, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="float32 queries"):
        torch.ops.eaglespec.tree_attention(torch.randn(4, 2, 16).bfloat16(), keys, values, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 keys"):
        torch.ops.eaglespec.tree_attention(torch.randn(4, 2, 16), keys.half(), values.half(), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_call_writes_and_attends_each_sequence_as_its_own_call(dtype):
    """tree_attention_batch (a batch's step, eaglespec.targets.pool): each sequence's rows are written to its own cache
    and attend over it with the bits of the one-sequence path (write_and_attend_tree), whatever the other sequences:
    plain one-row steps, causal blocks and trees of other sizes, over caches of other lengths and capacities."""
    from eaglespec.backends.cpu.attention import write_and_attend_batch, write_and_attend_tree

    heads, kv_heads, hd = 9, 3, 64
    shapes = [(37, 1, None), (5, 6, random_tree(6, 1).ancestor_mask()), (120, 3, None), (0, 4, None),
              (64, 9, random_tree(9, 2).ancestor_mask())]  # (cached rows, step rows, step mask or None: causal)
    g = torch.Generator().manual_seed(7)
    caches = [(torch.randn(kv_heads, hd, c + n + 11, generator=g).to(dtype),
               torch.randn(kv_heads, c + n + 11, hd, generator=g).to(dtype)) for c, n, _ in shapes]
    total = sum(n for _, n, _ in shapes)
    q = torch.randn(total, heads, hd, generator=g).transpose(0, 1)  # [H, N, hd], strided as the layers make it
    k, v = torch.randn(kv_heads, total, hd, generator=g), torch.randn(kv_heads, total, hd, generator=g)
    alone = [(keys.clone(), values.clone()) for keys, values in caches]
    expected, start = [], 0
    for (c, n, mask), (keys, values) in zip(shapes, alone):
        rows = slice(start, start + n)
        expected.append(write_and_attend_tree(q[:, rows], k[:, rows], v[:, rows], keys, values, c, mask))
        start += n
    out = write_and_attend_batch(q, k, v, [keys for keys, _ in caches], [values for _, values in caches],
                                 [c for c, _, _ in shapes], [n for _, n, _ in shapes], [m for _, _, m in shapes])
    assert torch.equal(out, torch.cat(expected, dim=1))
    for (keys, values), (keys_alone, values_alone) in zip(caches, alone):
        assert torch.equal(keys, keys_alone) and torch.equal(values, values_alone)
    with pytest.raises(RuntimeError, match="sizes add up"):
        write_and_attend_batch(q, k, v, [keys for keys, _ in caches], [values for _, values in caches],
                               [c for c, _, _ in shapes], [1] * len(shapes), [None] * len(shapes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_rows_moves_the_accepted_path_in_every_layer(dtype):
    """csrc/common/commit_rows.h: rows c + rows[i] -> c + i in every layer's transposed keys and values, the rest as it
    was; what FastTarget.commit did with one indexing call per cache."""
    keys_t = [torch.randn(3, 64, 50).to(dtype) for _ in range(4)]  # [Hkv, hd, capacity]
    values = [torch.randn(3, 50, 64).to(dtype) for _ in range(4)]  # [Hkv, capacity, hd]
    c, rows = 30, [0, 2, 5, 6]
    src = c + torch.tensor(rows)
    expected_k, expected_v = [k.clone() for k in keys_t], [v.clone() for v in values]
    for k, v in zip(expected_k, expected_v):
        k[..., c : c + len(rows)] = k[..., src]
        v[:, c : c + len(rows)] = v[:, src]
    torch.ops.eaglespec.commit_rows(keys_t, values, c, rows)
    assert all(torch.equal(a, b) for a, b in zip(keys_t, expected_k))
    assert all(torch.equal(a, b) for a, b in zip(values, expected_v))
    with pytest.raises(RuntimeError, match="rows must ascend"):
        torch.ops.eaglespec.commit_rows(keys_t, values, c, [0, 3, 2])


@pytest.fixture(scope="module")
def model():
    # head_dim 16, GQA; bfloat16 as the default dtype on a CPU with AVX-512 BF16 (and with --compile on AVX2)
    return make_cpu_model("llama", layers=3).to(torch.bfloat16)


def verify_rows_equal_plain_steps(target, prefix: list[int]) -> None:
    """Each row of a verify pass (after `prefix` decoded by plain steps) has the logits and features of the one-token
    steps that reach it; trees of 3 and 7 tokens (the compiled graphs for 2-4 and for 5+ tokens)."""
    one = torch.ones(1, 1, dtype=torch.bool)  # plain decoding's steps carry a root-only tree mask
    for tree in (TREE, DraftTree(torch.tensor([5, 11, 12]), torch.tensor([-1, 0, 0]))):
        target.reset()
        target.forward(PROMPT)
        target.commit()
        for token in prefix:
            target.forward(torch.tensor([token]), tree_mask=one)
            target.commit()
        verify = target.forward(tree.tokens, tree.positions(target.cache_len), tree.ancestor_mask())
        target.commit(torch.tensor([0]))
        for row in range(len(tree)):
            target.reset()
            target.forward(PROMPT)
            target.commit()
            for token in prefix + tree.tokens[tree.path(row)].tolist():
                plain = target.forward(torch.tensor([token]), tree_mask=one)
                target.commit()
            assert torch.equal(plain.logits[0], verify.logits[row]), f"row {row} of a {len(tree)}-token tree"
            assert torch.equal(plain.features[0], verify.features[row])


def test_exact_bfloat16_verify_rows_equal_plain_steps(model):
    """Row-invariant decode steps (--exact) attend through the kernel (not one attention call per row), also with
    torch's products."""
    exact = FastTarget(model, "final", row_invariant=True, kernels=False)
    assert exact.attention_kernel and exact.cache_dtype == torch.bfloat16  # every decode step through the kernel
    verify_rows_equal_plain_steps(exact, prefix=[])


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "python-layers"])
@pytest.mark.parametrize("dims", [{}, {"hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1,
                                       "intermediate_size": 176}], ids=["tiny", "odd-widths"])
def test_default_eager_bfloat16_verify_rows_equal_plain_steps(dims, stack, monkeypatch):
    """The default target (no flags): eager decode steps whose products, attention and greedy head are the kernels',
    the layers in one kernel call (backends.cpu.stack) or in Python ($EAGLESPEC_STACK=0). Every other operation of
    a step (norms, RoPE, SiLU, residual adds) works on each row alone, so a tree row has the bits of the one-token
    steps that reach it; widths that leave vector tails are included."""
    monkeypatch.setenv("EAGLESPEC_STACK", "1" if stack else "0")
    model = make_cpu_model("llama", layers=3, **dims).to(torch.bfloat16)
    target = FastTarget(model, "final")
    assert target.bf16_gemm and target.tree_kernel and not target.compiled and target.greedy_head is not None
    assert (target.kernel_stack is not None) == stack
    verify_rows_equal_plain_steps(target, prefix=[7, 3])


@pytest.fixture(scope="module")
def compiled(model):
    """--compile with the layers in Python ($EAGLESPEC_STACK=0): their compiled graphs (with the kernel stack,
    --compile leaves a target's steps to it, test_stack.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EAGLESPEC_STACK", "0")
        target = FastTarget(model, "final", compile=True)
    assert target.stack is not None
    target.warm_up()
    return target


def test_compiled_bfloat16_verify_rows_equal_plain_steps(compiled):
    """The whole compiled decode step, not just its attention: with eager's bfloat16 roundings
    (compiled.compile_settings) a compiled tree row has the bits of the compiled one-token steps."""
    assert compiled.tree_kernel and compiled.cache_dtype == torch.bfloat16
    verify_rows_equal_plain_steps(compiled, prefix=[7])  # (decode steps over a cached prefix run compiled)


@pytest.mark.parametrize("option", ["default", "exact", "compile", "python-layers", "python-layers-compile"])
def test_bfloat16_speculative_tokens_equal_plain_decoding(model, option, monkeypatch):
    head = random_head(model, "eagle1").to(torch.bfloat16)
    if option.startswith("python-layers"):
        monkeypatch.setenv("EAGLESPEC_STACK", "0")
    flags = {"compile": True} if option.endswith("compile") else {"exact": True} if option == "exact" else {}
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", **flags)
    spec = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", **flags,
                             tree=TreeSettings(total_tokens=8, depth=4, top_k=3))
    assert spec.target.attention_kernel and spec.target.tree_kernel
    # both pick greedy tokens through the screened LM head (bf16gemm.GreedyHead), not the logits
    assert spec.target.greedy_head is not None and plain.target.greedy_head is not None
    taus = []
    for prompt in PROMPTS:
        expected = plain.generate(prompt, max_new_tokens=40)
        got = spec.generate(prompt, max_new_tokens=40)
        assert got.tokens == expected.tokens
        taus.append(got.stats.tau)
    assert max(taus) > 1.0  # drafts were verified and some accepted, not just plain steps


def test_compiled_bfloat16_target_attends_through_the_kernel(model, compiled):
    """--compile: the decode graphs call the kernel; their rows stay close to the eager path's (other products and
    attention: close, not bit-equal)."""
    eager = FastTarget(model, "final", kernels=False)
    assert compiled.tree_kernel and not eager.tree_kernel
    assert eager.cache_dtype == torch.float32  # its decode steps attend through torch: a float32 cache
    for t in (eager, compiled):
        t.reset()
        t.forward(PROMPT)
        t.commit()
        t.forward(torch.tensor([7]))
        t.commit()
    outs = [t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask()) for t in (eager, compiled)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=0.1, rtol=0.05)
    assert torch.equal(outs[1].logits.argmax(-1), outs[0].logits.argmax(-1))
