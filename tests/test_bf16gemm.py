"""eaglespec's few-row bfloat16 kernel (eaglespec.backends.cpu.kernels): the float32-accumulated product rounded once,
the same bits for a row whatever else is in the call, shapes that do not fill its tiles, and use inside torch.compile
and by a compiled bfloat16 target. They run on the build this CPU loads (AVX-512 BF16 or AVX2 + FMA, `bf16gemm.isa()`);
skipped where the CPU has neither or no C++ compiler exists."""

import pytest
import torch
from conftest import make_cpu_model
from test_fastpath import PROMPT, TREE

from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.errors import EagleSpecError
from eaglespec.targets.fast import FastTarget

pytestmark = [
    pytest.mark.skipif(not bf16gemm.cpu_supported(), reason="this CPU has neither AVX-512 BF16 nor AVX2 + FMA"),
    pytest.mark.skipif(not bf16gemm.can_build(), reason="building the kernel needs a C++ compiler and ninja"),
]

# (N, K, bias): model-like shapes, a partial last column group, odd input widths (padded to k-pairs), tiny ones
SHAPES = [(960, 576, False), (576, 1536, True), (100, 577, True), (7, 3, False), (130, 64, True)]
# the multiply loops of this CPU's build (the AVX2 build has the FMA loop only)
LOOPS = sorted(bf16gemm.isa().variants) if bf16gemm.cpu_supported() else []
LOOP = bf16gemm.VARIANTS[LOOPS[-1]] if LOOPS else 1  # a loop every build has (fma)


@pytest.fixture(params=LOOPS)
def variant(request, monkeypatch):
    """Each multiply loop of the kernel (vdpbf16ps and float32 FMAs), forced through $EAGLESPEC_BF16_KERNEL."""
    monkeypatch.setenv(bf16gemm.VARIANT_ENV, request.param)
    bf16gemm.variant.cache_clear()
    yield request.param
    bf16gemm.variant.cache_clear()


def reference(x, weight, bias):
    y = x.double() @ weight.double().T  # exact products of bfloat16 values
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("n,k,with_bias", SHAPES)
def test_matches_the_product_and_is_row_invariant(n, k, with_bias, variant):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    linear = bf16gemm.Bf16Linear(weight, bias)
    assert linear.variant == bf16gemm.VARIANTS[variant]
    x = torch.randn(17, k).bfloat16()
    whole = linear(x)  # [17, n]: tiles of 6 + 6 + 5 rows
    assert whole.dtype == torch.bfloat16 and whole.shape == (17, n)
    exact = reference(x, weight, bias)
    # float32 accumulation, one rounding to bfloat16: within a bfloat16 ulp of the exact value, plus the float32
    # sum's own error (K terms)
    bound = exact.abs() * 2**-8 + 1e-5 * k * (x.float().abs() @ weight.float().abs().T)
    assert ((whole.float() - exact).abs() <= bound).all()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):  # every path, tile size and split
        part = linear(x[:rows])
        assert torch.equal(part, whole[:rows]), f"rows of a {rows}-row call differ from the 17-row call"
    assert torch.equal(linear(x[9:10]), whole[9:10])


def test_long_inputs_run_in_chunks_with_the_same_bits(variant):
    """More than 64 rows (a prefill) take several passes over the weights; every row keeps its one-row bits, and
    calls of 7-64 rows (several tiles taking turns over blocks of k) match them too."""
    torch.manual_seed(3)
    weight, bias = torch.randn(200, 1000).bfloat16(), torch.randn(200).bfloat16()
    linear = bf16gemm.Bf16Linear(weight, bias)
    x = torch.randn(150, 1000).bfloat16()
    whole = linear(x)
    single = torch.cat([linear(x[i : i + 1]) for i in range(150)])
    assert torch.equal(whole, single)
    for rows in (7, 13, 24, 64, 65):
        assert torch.equal(linear(x[:rows]), single[:rows]), f"a {rows}-row call differs from one-row calls"


def test_leading_dimensions_and_empty_input():
    weight = torch.randn(70, 32).bfloat16()
    linear = bf16gemm.Bf16Linear(weight)
    x = torch.randn(2, 3, 32).bfloat16()
    assert torch.equal(linear(x), linear(x.reshape(6, 32)).view(2, 3, 70))
    assert linear(x[:0]).shape == (0, 3, 70)


def test_mismatched_input_is_a_clear_error():
    linear = bf16gemm.Bf16Linear(torch.randn(64, 32).bfloat16())
    with pytest.raises(RuntimeError, match="does not match the packed weight"):
        torch.ops.eaglespec.bf16_linear(torch.randn(2, 40).bfloat16(), linear.packed, 64, None, LOOP)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.eaglespec.bf16_linear(torch.randn(2, 32), linear.packed, 64, None, LOOP)


def test_inside_torch_compile():
    torch.manual_seed(0)
    up, down = bf16gemm.Bf16Linear(torch.randn(96, 64).bfloat16()), bf16gemm.Bf16Linear(torch.randn(64, 96).bfloat16())

    def block(x):
        return x + down(torch.nn.functional.silu(up(x)))

    x = torch.randn(3, 64).bfloat16()
    compiled = torch.compile(block, dynamic=True)
    assert torch.equal(compiled(x), block(x))
    assert torch.equal(compiled(x[:2]), block(x[:2]))
    scores = bf16gemm.Int8Linear(torch.randn(40, 64).bfloat16())  # the draft LM head's int8 product, in a graph too
    hidden = block(x).float()
    log_probs = torch.compile(lambda h: torch.log_softmax(scores(h), -1), dynamic=True)
    torch.testing.assert_close(log_probs(hidden), torch.log_softmax(scores(hidden), -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", LOOPS)
def test_inside_a_cpp_wrapper_graph_with_either_loop(variant):
    """The kernel in a graph compiled with the decode graphs' settings (freezing, inductor's C++ wrapper), each
    multiply loop. (SmolLM2's compiled decode stack once failed with the vdpbf16ps loop: the C++ wrapper left out a
    variant argument equal to its schema default; the schema has no default now. This small graph did not show it.)"""
    from eaglespec.backends.cpu.compiled import compile_settings

    torch.manual_seed(1)
    up = bf16gemm.Bf16Linear(torch.randn(96, 64).bfloat16())
    up.variant = bf16gemm.VARIANTS[variant]
    x = torch.randn(3, 64).bfloat16()
    expected = up(x)
    torch._dynamo.reset()
    with compile_settings(autotune=False), torch.inference_mode():
        compiled = torch.compile(lambda h: up(h) * 2, dynamic=True)
        assert torch.equal(compiled(x), expected * 2)


@pytest.fixture(scope="module")
def model():
    return make_cpu_model("qwen2", layers=2).to(torch.bfloat16)  # q/k/v biases and GQA


def test_bfloat16_targets_use_the_kernel_eager_and_compiled(model, monkeypatch):
    """The layers in Python ($EAGLESPEC_STACK=0), eager or compiled, call the kernel's products."""
    monkeypatch.setenv("EAGLESPEC_STACK", "0")
    eager = FastTarget(model, "final", kernels=False)  # torch's products (oneDNN), for comparison
    assert FastTarget(model, "final").bf16_gemm  # the default, eager
    compiled = FastTarget(model, "final", compile=True)
    assert compiled.bf16_gemm and not eager.bf16_gemm
    assert isinstance(compiled.logits_head, bf16gemm.Bf16Linear)
    assert all(isinstance(layer.qkv, bf16gemm.Bf16Linear) for layer in compiled.layers)
    compiled.warm_up()
    for t in (eager, compiled):
        t.reset()
        t.forward(PROMPT)
        t.commit()
    steps = compiled.compiled_steps
    outs = [t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask()) for t in (eager, compiled)]
    assert compiled.compiled_steps == steps + 1
    # bfloat16 products of another kernel (other sums, other roundings): close, not equal
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=0.1, rtol=0.05)
    torch.testing.assert_close(outs[1].features.float(), outs[0].features.float(), atol=0.05, rtol=0.05)
    assert torch.equal(outs[1].logits.argmax(-1), outs[0].logits.argmax(-1))


def test_tree_calibration_is_kept_per_multiply_loop(model, monkeypatch):
    """`--tree auto` times verify passes: a target on the kernel is cached under the loop and the build it runs
    (each loop of this CPU's build), a target without the kernel under neither."""
    from eaglespec.drafters import autotree

    keys = {}
    for name in LOOPS:
        monkeypatch.setenv(bf16gemm.VARIANT_ENV, name)
        bf16gemm.variant.cache_clear()
        keys[name] = (autotree._target_key(FastTarget(model, "final", compile=True)),
                      autotree._target_key(FastTarget(model, "final", kernels=False)))
    bf16gemm.variant.cache_clear()
    for compiled_key, eager_key in keys.values():
        assert f"|{bf16gemm.isa().name}|" in compiled_key and compiled_key != eager_key
    if len(LOOPS) == 2:
        assert keys["dpbf16"][0] != keys["fma"][0]
        assert keys["dpbf16"][1] == keys["fma"][1]  # no kernel, nothing to tell apart


@pytest.mark.parametrize("kind, int8", [("eagle1", True), ("eagle3", True), ("eagle1", False), ("eagle3", False)])
def test_compiled_bfloat16_drafter_runs_its_head_through_the_kernel(model, kind, int8, monkeypatch):
    """Under --compile a bfloat16 head's products (layer step, EAGLE-3 fusion, draft LM head or EAGLE-1's rows of
    the target's) use the kernel, the draft LM head an int8 copy unless EAGLESPEC_DRAFT_INT8=0: the compiled drafter
    drafts what an eager drafter over the same kernel drafts, with no recompiles."""
    from test_engine import random_head
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from eaglespec import TreeSettings
    from eaglespec.backends.cpu.apply import eagle_drafter
    from eaglespec.backends.cpu.compiled import HeadStep
    from eaglespec.drafters import EagleDrafter

    monkeypatch.setenv(bf16gemm.DRAFT_INT8_ENV, "1" if int8 else "0")
    lm_head = bf16gemm.Int8Linear if int8 else bf16gemm.Bf16Linear
    head = random_head(model, kind).to(torch.bfloat16)
    target = FastTarget(model, "eagle3" if kind == "eagle3" else "final")
    settings = TreeSettings(total_tokens=6, depth=3, top_k=2)
    compiled = eagle_drafter(head, target.embed_tokens, target.lm_head, "dynamic", settings, compile=True)
    kernel_layers = [m for m in compiled.head.modules() if isinstance(m, (bf16gemm.Bf16Linear, bf16gemm.Int8Linear))]
    assert len(kernel_layers) == sum(isinstance(m, torch.nn.Linear) for m in head.modules()) > 0
    eager_head = bf16gemm.with_kernel(head)
    if kind == "eagle1":
        assert compiled.head.pack_rows is lm_head
        eager_head.pack_rows = lm_head
    else:
        assert isinstance(compiled.head.lm_head, lm_head)
        eager_head.lm_head = lm_head(head.lm_head.weight)
    eager = EagleDrafter(eager_head, target.embed_tokens, target.lm_head, "dynamic", settings)
    graphs = len(_debug_get_cache_entry_list(HeadStep.forward.__code__))
    gen = torch.Generator().manual_seed(0)
    features = (3 if kind == "eagle3" else 1) * model.config.hidden_size
    tokens = torch.randint(0, model.config.vocab_size, (10,), generator=gen)
    new_features = torch.randn(9, features, generator=gen).bfloat16()
    for k in (1, 3, 2):
        trees = [d.draft(tokens, new_features) for d in (eager, compiled)]
        assert torch.equal(trees[1].tokens, trees[0].tokens) and torch.equal(trees[1].parents, trees[0].parents)
        # inductor rounds fused elementwise work to bfloat16 once, eager after each op: close scores
        torch.testing.assert_close(trees[1].scores, trees[0].scores, atol=0.05, rtol=0.02)
        tokens = torch.cat([tokens, torch.randint(0, model.config.vocab_size, (k,), generator=gen)])
        new_features = torch.randn(k, features, generator=gen).bfloat16()
    assert len(_debug_get_cache_entry_list(HeadStep.forward.__code__)) == graphs
    if kind == "eagle1":  # the draft rows went through the kernel, whether or not oneDNN packs bfloat16 here
        assert isinstance(compiled.head._rows[1], lm_head)


def test_a_failed_build_is_a_clear_error(monkeypatch):
    import torch.utils.cpp_extension

    from eaglespec.errors import EagleSpecError

    def broken(*args, **kwargs):
        raise RuntimeError("g++: internal compiler error")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    with pytest.raises(EagleSpecError, match="EAGLESPEC_BF16_GEMM=0"):
        bf16gemm.load.__wrapped__()  # (load() itself is cached: the kernel is already built in this process)


def test_the_multiply_loop_is_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    """Without $EAGLESPEC_BF16_KERNEL the faster loop is measured, kept only if clearly faster, and read back from
    the cache on later runs (so a machine always gets the same bits)."""
    # variant() loads the kernels: load this CPU's build now, before `isa` names one this CPU may not run
    bf16gemm.load()
    monkeypatch.setattr(bf16gemm, "isa", lambda: bf16gemm.ISAS["avx512"])  # (a build with two loops)
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(bf16gemm.VARIANT_ENV, raising=False)
    bf16gemm.variant.cache_clear()
    try:
        monkeypatch.setattr(bf16gemm, "_time_variants", lambda threads: {"dpbf16": 1.4, "fma": 1.0})
        assert bf16gemm.variant() == "fma"
        assert list((tmp_path / "kernels").glob("*.json"))

        def not_again(threads):
            raise AssertionError("measured again although the choice is cached")

        monkeypatch.setattr(bf16gemm, "_time_variants", not_again)
        bf16gemm.variant.cache_clear()
        assert bf16gemm.variant() == "fma"

        for path in (tmp_path / "kernels").glob("*.json"):
            path.unlink()
        monkeypatch.setattr(bf16gemm, "_time_variants", lambda threads: {"dpbf16": 1.05, "fma": 1.0})
        bf16gemm.variant.cache_clear()
        assert bf16gemm.variant() == "dpbf16"  # within the margin: vdpbf16ps stays

    finally:
        bf16gemm.variant.cache_clear()
    if len(LOOPS) == 2:
        times = bf16gemm._time_variants(1)  # the real measurement runs and times both loops
        assert set(times) == set(bf16gemm.VARIANTS) and all(ms > 0 for ms in times.values())


def test_a_build_with_one_loop_uses_it_without_measuring(monkeypatch, tmp_path):
    """The AVX2 build has the FMA loop only: chosen without a measurement or a cache file; forcing the other loop is
    a clear error, from the loaded AVX2 kernel too (the AVX-512 build runs both loops)."""
    loaded = bf16gemm.isa()  # the build this CPU loads (`isa` names the AVX2 build below, whatever the CPU)
    bf16gemm.load()
    monkeypatch.setattr(bf16gemm, "isa", lambda: bf16gemm.ISAS["avx2"])
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(bf16gemm.VARIANT_ENV, raising=False)

    def never(threads):
        raise AssertionError("measured with one loop to choose from")

    monkeypatch.setattr(bf16gemm, "_time_variants", never)
    bf16gemm.variant.cache_clear()
    try:
        assert bf16gemm.variant() == "fma" and not (tmp_path / "kernels").exists()
        monkeypatch.setenv(bf16gemm.VARIANT_ENV, "dpbf16")
        bf16gemm.variant.cache_clear()
        with pytest.raises(EagleSpecError, match="avx2 build of the kernel has only the fma loop"):
            bf16gemm.variant()
    finally:
        bf16gemm.variant.cache_clear()
    x, weight = torch.randn(2, 32).bfloat16(), torch.randn(64, 32).bfloat16()
    packed_weight = torch.ops.eaglespec.bf16_pack(weight)
    if loaded.name == "avx2":
        with pytest.raises(RuntimeError, match="only the float32 FMA loop"):
            torch.ops.eaglespec.bf16_linear(x, packed_weight, 64, None, bf16gemm.VARIANTS["dpbf16"])
    else:
        assert "dpbf16" in loaded.variants
        y = torch.ops.eaglespec.bf16_linear(x, packed_weight, 64, None, bf16gemm.VARIANTS["dpbf16"])
        torch.testing.assert_close(y.float(), reference(x, weight, None), atol=0.05, rtol=0.02)


def test_an_unknown_loop_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(bf16gemm.VARIANT_ENV, "amx")
    bf16gemm.variant.cache_clear()
    try:
        with pytest.raises(EagleSpecError, match="use auto, dpbf16 or fma"):
            bf16gemm.variant()
    finally:
        bf16gemm.variant.cache_clear()
    with pytest.raises(RuntimeError, match="variant must be 0"):
        torch.ops.eaglespec.bf16_linear(torch.randn(2, 32).bfloat16(), torch.ops.eaglespec.bf16_pack(
            torch.randn(64, 32).bfloat16()), 64, None, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_gives_torch_argmax_answer(dtype):
    """The verified rows' greedy choices: first index of each row's maximum, ties and NaN as torch.argmax."""
    bf16gemm.load()
    torch.manual_seed(1)
    for n, v in [(1, 49152), (6, 8192), (3, 1000), (2, 7), (1, 16), (4, 33)]:
        logits = torch.randn(n, v).to(dtype)
        assert torch.equal(torch.ops.eaglespec.argmax_rows(logits), logits.argmax(-1)), (n, v)
    tied = torch.zeros(3, 100, dtype=dtype)
    tied[0, [17, 5, 90]] = 2.0  # first of three equal maxima
    tied[1] = float("-inf")  # all -inf: index 0
    tied[2, [40, 70]] = float("nan")  # NaN counts as the maximum: the first NaN
    tied[2, 10] = 5.0
    assert torch.ops.eaglespec.argmax_rows(tied).tolist() == [5, 0, 40] == tied.argmax(-1).tolist()
    assert bf16gemm.loaded()
    assert torch.equal(bf16gemm.argmax_rows(tied[:, :50].T.contiguous().T), tied[:, :50].argmax(-1))  # strided rows


def test_topk_rows_gives_the_k_best_in_order():
    """The draft's top-k: torch.topk's values and indices (distinct values), equal values by ascending index,
    -inf entries, k = V, one-dimensional input; a row with a NaN falls back to torch.topk."""
    bf16gemm.load()
    torch.manual_seed(2)
    for n, v, k in [(1, 8192, 2), (3, 8192, 8), (2, 1000, 64), (1, 17, 17), (4, 5, 3), (1, 16, 1)]:
        scores = torch.randn(n, v).log_softmax(-1)
        values, indices = bf16gemm.topk_rows(scores, k)
        expected = torch.topk(scores, k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices), (n, v, k)
    tied = torch.full((2, 40), -5.0)
    tied[0, [30, 3, 12]] = -1.0  # three equal best: ascending index
    tied[0, 20] = -0.5
    tied[1] = float("-inf")
    tied[1, 39] = 0.0
    values, indices = bf16gemm.topk_rows(tied, 4)
    assert indices.tolist() == [[20, 3, 12, 30], [39, 0, 1, 2]]
    assert values.tolist() == [[-0.5, -1.0, -1.0, -1.0], [0.0] + [float("-inf")] * 3]
    one = torch.randn(300)
    assert torch.equal(bf16gemm.topk_rows(one, 5)[1], torch.topk(one, 5).indices)  # [V] -> [k]
    nan = torch.randn(2, 50)
    nan[1, 7] = float("nan")
    assert torch.equal(bf16gemm.topk_rows(nan, 3)[1], torch.topk(nan, 3).indices)
    assert bf16gemm.topk_rows(torch.randn(1, 100), 65)[0].shape == (1, 65)  # beyond the kernel's k: torch.topk


@pytest.mark.parametrize("n, k", [(1000, 64), (49152, 576), (37, 18), (100, 33)])
def test_screened_argmax_is_the_exact_argmax(n, k):
    """Greedy decoding's screened LM head: the argmax of the exact logits (float64 here) for rows of every count,
    ragged N and K, the lowest id among equal rows; a row alone gets the answer it gets among others."""
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.05).bfloat16()
    head = bf16gemm.GreedyHead(w)
    x = torch.randn(19, k).bfloat16()  # 19 rows: a pass of 16 (two tiles of 8 a group) and one of 3
    best = head(x)
    assert torch.equal(best, (x.double() @ w.double().T).argmax(-1))
    assert [int(head(x[r : r + 1])[0]) for r in range(19)] == best.tolist()
    assert torch.equal(head(x[:11]), best[:11])  # one pass, tiles of 6 and 5
    tied = w.clone()
    tied[n // 2] = tied[n // 3] = 4 * w[0]  # two equal best rows for x = w[0]
    assert int(bf16gemm.GreedyHead(tied)(w[:1].float().bfloat16())[0]) == n // 3
    bad = x[:2].clone()
    bad[1, 0] = float("nan")
    assert head(bad) is None  # the caller computes the logits


def test_greedy_forward_gives_the_logits_argmax(model):
    """A compiled bfloat16 target's greedy forward returns tokens, not logits, and they are its logits' argmax."""
    target = FastTarget(model, "final", compile=True)
    assert target.greedy_head is not None
    target.warm_up()
    target.forward(PROMPT)
    target.commit()
    c = target.cache_len
    full = target.forward(TREE.tokens, TREE.positions(c), TREE.ancestor_mask())
    target.commit(torch.zeros(0, dtype=torch.long))
    greedy = target.forward(TREE.tokens, TREE.positions(c), TREE.ancestor_mask(), greedy=True)
    assert greedy.head_logits is None and torch.equal(greedy.features, full.features)
    # the argmax of the exact logits of the LM head's input (the "final" features), not of bfloat16-rounded ones
    exact = full.features.double() @ target.lm_head.weight.double().T
    assert greedy.greedy() == exact.argmax(-1).tolist()
    assert full.greedy() == full.logits.argmax(-1).tolist()  # without greedy=True: the logits' argmax
    with pytest.raises(RuntimeError, match="greedy tokens only"):
        greedy.logits


@pytest.mark.parametrize("n, k, with_bias", [(1000, 64, True), (8192, 576, False), (37, 18, True), (100, 1152, False)])
def test_int8_linear_is_close_to_the_product(n, k, with_bias):
    """The draft heads' int8 products: within the screen's bound of the float64 product (one scale per weight row,
    the input per block of 32 channels, an outlier channel included), the same for a row alone or among others,
    NaN for a row that is not finite."""
    torch.manual_seed(n + k)
    w = (torch.randn(n, k) * 0.05).bfloat16()
    bias = torch.randn(n) if with_bias else None
    layer = bf16gemm.Int8Linear(w, bias)
    x = torch.randn(19, k)  # a pass of 16 rows (two tiles of 8 a group) and one of 3
    x[:, 3] *= 40  # an outlier channel, as target features have
    y = layer(x)  # [19, n] float32
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    _, _, b1, b2 = bf16gemm.int8_rows(w)
    blocks = torch.nn.functional.pad(x.abs(), (0, -k % 32)).view(19, -1, 32).amax(-1) / 127  # [19, K32]
    bound = x.abs().sum(-1, keepdim=True).double() * b1[:n].double() + blocks.sum(-1, keepdim=True).double() * b2[:n]
    assert y.dtype == torch.float32 and y.shape == (19, n)
    assert bool(((y.double() - exact).abs() <= bound).all())
    assert (y.double() - exact).abs().max() < 0.05 * exact.abs().max()  # and close in practice
    assert torch.equal(torch.cat([layer(x[r : r + 1]) for r in range(19)]), y)
    assert torch.equal(layer(x[:11]), y[:11])  # one pass, tiles of 6 and 5
    assert torch.equal(layer(x.bfloat16()[:, None])[:, 0], layer(x.bfloat16().float()).bfloat16())  # [..., K], dtype
    bad = x[:2].clone()
    bad[1, 0] = float("nan")
    out = layer(bad)
    assert bool(out[1].isnan().all()) and torch.equal(out[0], y[0])
