"""The batch decoder's prefix cache (eaglespec.spec.prefix): prompts that start like one read before take its rows
instead of reading them, and every token stays the one batch-1 decoding gives; the cache finds the longest
block-aligned prefix, never answers with another prompt's rows, and keeps to its budget."""

from __future__ import annotations

import pytest
import torch
from test_batch import ForwardSpy, batch_one, drain, make_engine, needs_kernels

from eaglespec.spec import prefix as prefix_module
from eaglespec.spec.prefix import BLOCK, PrefixCache
from eaglespec.targets.cache_rows import CacheRows

SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]  # 20 tokens: 2 blocks + 4
PROMPTS = [SHARED + [7, 1], SHARED + [9, 9, 4, 2, 71, 6, 6, 6, 6, 1], SHARED[:17] + [12], SHARED + [7, 1], [5, 6]]
NEWS = [12, 9, 14, 12, 6]


def rows(length: int, value: float = 0.0) -> CacheRows:
    """One layer's keys and values [kv_heads=2, length, head_dim=4]."""
    return CacheRows([torch.full((2, length, 4), value)], [torch.full((2, length, 4), value + 1)])


def test_lookup_finds_the_longest_whole_blocks_short_of_the_last_token():
    cache = PrefixCache()
    prompt = list(range(100, 100 + 3 * BLOCK + 2))
    assert cache.lookup(prompt, needs_features=False) is None
    assert cache.blocks_to_store(prompt) == 3 * BLOCK
    cache.store(prompt, rows(3 * BLOCK), features=torch.ones(3 * BLOCK, 5))
    assert cache.blocks_to_store(prompt) == 0  # held already
    hit = cache.lookup(prompt, needs_features=True)
    assert hit.length == 3 * BLOCK and hit.rows.values[0].shape == (2, 3 * BLOCK, 4) and hit.features.shape == (24, 5)
    # a prompt of exactly three blocks reads its last token: two blocks come from the cache
    assert cache.lookup(prompt[: 3 * BLOCK], needs_features=False).length == 2 * BLOCK
    # sharing one block and a half: one block
    assert cache.lookup(prompt[: BLOCK + 4] + [1, 2, 3, 4, 5], needs_features=False).length == BLOCK
    assert cache.lookup([1] + prompt, needs_features=False) is None
    assert (cache.hits, cache.lookups, cache.rows_reused) == (3, 5, 6 * BLOCK)


def test_a_hit_needs_the_features_the_drafter_reads_and_the_same_tokens(monkeypatch):
    cache = PrefixCache()
    prompt = list(range(2 * BLOCK + 1))
    cache.store(prompt, rows(2 * BLOCK), features=None)
    assert cache.lookup(prompt, needs_features=True) is None
    assert cache.lookup(prompt, needs_features=False).length == 2 * BLOCK
    # every block hashing alike (a collision): another prompt must not get these rows
    monkeypatch.setattr(prefix_module, "_block_hashes", lambda tokens, blocks: list(range(blocks)))
    assert cache.lookup([99] * (2 * BLOCK + 1), needs_features=False) is None


def test_the_least_recently_used_prompts_go_first_within_the_budget():
    entry = rows(BLOCK).nbytes
    cache = PrefixCache(max_bytes=2 * entry)
    a, b, c = ([base + i for i in range(BLOCK + 1)] for base in (0, 100, 200))
    cache.store(a, rows(BLOCK), features=None)
    cache.store(b, rows(BLOCK), features=None)
    assert cache.lookup(a, needs_features=False) is not None  # a is now the most recently used
    cache.store(c, rows(BLOCK), features=None)
    assert cache.bytes == 2 * entry
    assert cache.lookup(b, needs_features=False) is None
    assert cache.lookup(a, needs_features=False) is not None and cache.lookup(c, needs_features=False) is not None
    assert PrefixCache(max_bytes=0).blocks_to_store(a) == 0
    with pytest.raises(ValueError, match="0 or more bytes"):
        PrefixCache(max_bytes=-1)


def test_cache_rows_take_a_prefix_in_their_own_key_layout():
    values = [torch.arange(2 * 6 * 4.0).reshape(2, 6, 4)]  # [kv_heads, length=6, head_dim]
    keys = [torch.arange(2 * 4 * 6.0).reshape(2, 4, 6)]  # [kv_heads, head_dim, length]: the kernel's layout
    first = CacheRows(keys, values, keys_transposed=True).prefix(3)
    assert first.length == 3 and first.keys_transposed
    assert torch.equal(first.keys[0], keys[0][:, :, :3]) and torch.equal(first.values[0], values[0][:, :3])
    plain = CacheRows([k.transpose(1, 2) for k in keys], values)
    assert torch.equal(plain.prefix(3).keys[0], first.keys[0].transpose(1, 2))
    assert plain.prefix(3).nbytes == first.nbytes == 2 * 2 * 3 * 4 * 4
    for length in (0, 7):
        with pytest.raises(ValueError, match=f"cannot take {length} rows of 6"):
            plain.prefix(length)


@needs_kernels
@pytest.mark.parametrize("method,arch,head_kind", [("vanilla", "qwen2", "eagle1"), ("eagle2", "qwen2", "eagle3"),
                                                   ("eagle2", "llama", "eagle1"), ("sps", "llama", "eagle1")])
def test_prompts_sharing_a_prefix_read_only_the_rest_and_decode_as_batch_one(method, arch, head_kind, monkeypatch):
    engine = make_engine(method, arch, torch.bfloat16, head_kind=head_kind)
    expected = batch_one(engine, PROMPTS, NEWS)
    for speculate in ("always", "auto"):
        batch = engine.batch_decoder(max_batch=2, speculate=speculate, prefill_chunk=8)
        assert batch.prefixes is not None
        spy = ForwardSpy(batch.pool, monkeypatch)
        for i, (prompt, n) in enumerate(zip(PROMPTS, NEWS)):
            batch.add(i, prompt, max_new_tokens=n)
        reports = []
        _, finished = drain(batch, steps=reports)
        assert {k: f.tokens for k, f in finished.items()} == expected, speculate
        assert sum(r.prefix_rows for r in reports) == batch.prefixes.rows_reused
        # the first two prompts join together and are read whole; the next two take 16 of their rows each from the
        # cache (while another sequence decodes), the last shares nothing
        assert batch.prefixes.rows_reused == 2 * 2 * BLOCK
        assert sum(map(sum, spy.pieces)) == sum(map(len, PROMPTS)) - 2 * 2 * BLOCK
        assert spy.mixed
        assert sorted(batch.pool.free) == [0, 1]


@needs_kernels
def test_the_prefix_cache_can_be_turned_off(monkeypatch):
    engine = make_engine("vanilla", "qwen2", torch.bfloat16)
    batch = engine.batch_decoder(max_batch=2, prefix_cache_bytes=0)
    assert batch.prefixes is None
    spy = ForwardSpy(batch.pool, monkeypatch)
    for i, (prompt, n) in enumerate(zip(PROMPTS, NEWS)):
        batch.add(i, prompt, max_new_tokens=n)
    drain(batch)
    assert sum(map(sum, spy.pieces)) == sum(map(len, PROMPTS))


@needs_kernels
@pytest.mark.parametrize("arch,head_kind", [("qwen2", "eagle3"), ("llama", "eagle1")])
def test_rows_loaded_from_a_prompt_read_before_are_the_rows_reading_them_gives(arch, head_kind):
    """The exactness the prefix cache rests on: a slot that loads a prompt's first 16 rows (`cached_rows`, then
    `load_rows`) and reads the rest ends with the cache, features and logits of a slot that read it all."""
    engine = make_engine("eagle2", arch, torch.bfloat16, head_kind=head_kind)
    pool = engine.batch_decoder(max_batch=2).pool
    prompt, length = torch.tensor(PROMPTS[1]), 2 * BLOCK
    whole, loaded = pool.acquire(), pool.acquire()
    read = pool.forward([(whole, prompt, None, None, slice(-1, None))])[0]
    pool[whole].commit()
    stored = pool[whole].cached_rows(length)
    with pytest.raises(ValueError, match="another key layout"):
        pool[loaded].load_rows(CacheRows(stored.keys, stored.values, not stored.keys_transposed))
    pool[loaded].load_rows(stored)
    rest = pool.forward([(loaded, prompt[length:], None, None, slice(-1, None))])[0]
    pool[loaded].commit()
    assert pool[loaded].cache_len == pool[whole].cache_len == len(prompt)
    a, b = pool[whole].cached_rows(len(prompt)), pool[loaded].cached_rows(len(prompt))
    assert a.keys_transposed == b.keys_transposed
    assert all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)))
    assert torch.equal(rest.features, read.features[length:])
    assert torch.equal(rest.logits, read.logits)


def test_serve_takes_the_prefix_caches_budget():
    from eaglespec.cli import build_parser

    assert build_parser().parse_args(["serve"]).prefix_cache_mb == 256.0
    assert build_parser().parse_args(["serve", "--prefix-cache-mb", "0"]).prefix_cache_mb == 0.0


@needs_kernels
def test_the_batched_server_worker_forgets_the_prompts_between_steps_when_asked():
    import time

    from eaglespec.serve.batch_worker import BatchWorker
    from eaglespec.serve.metrics import ServerMetrics

    engine = make_engine("vanilla", "qwen2", torch.bfloat16)
    worker = BatchWorker(engine, ServerMetrics("tiny"), max_batch=2)
    prefixes = worker.batch.prefixes
    prefixes.store(SHARED, rows(2 * BLOCK), features=None)
    worker.start()
    try:
        assert worker.reset_prefix_cache()
        deadline = time.monotonic() + 10
        while prefixes.stored:
            assert time.monotonic() < deadline, "the worker did not clear its prefix cache"
            time.sleep(0.01)
        assert prefixes.bytes == 0 and prefixes.lookup(SHARED, needs_features=False) is None
    finally:
        worker.stop()
