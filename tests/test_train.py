"""Training pipeline on a tiny random Llama target with a character-level chat tokenizer: data, objectives,
checkpoints and resume, evaluation, vocabulary maps, export / import, errors."""

from __future__ import annotations

import copy
import gc
import json
import random
import string
import weakref
from dataclasses import replace

import pytest
import torch
from conftest import make_model
from safetensors.torch import load_file, save_file

from eaglespec.api import Engine
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.errors import CheckpointError, EagleSpecError
from eaglespec.heads import build_head, load_head, read_draft_vocab, save_head
from eaglespec.heads.config import HeadConfig
from eaglespec.heads.layer import KVCache
from eaglespec.targets.fast import FastTarget, make_target
from eaglespec.targets.hf import TargetModel
from eaglespec.train.data import (
    eaglespec_generator,
    encode_conversation,
    encode_dataset,
    read_conversations,
    self_distill,
    transformers_generator,
)
from eaglespec.train.export import export_head
from eaglespec.train.features import (
    CachedFeatures,
    OnlineFeatures,
    map_safetensors,
    open_feature_stores,
    pad_examples,
)
from eaglespec.train.trainer import TrainConfig, Trainer, lr_lambda, split_indices
from eaglespec.train.vocab import select_draft_vocab, token_counts

CHARS = string.ascii_lowercase + " .,?\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer():
    """A real (fast) character-level tokenizer with a ChatML template: 3 specials + 31 characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def sentence(rng: random.Random, words: int) -> str:
    return " ".join("".join(rng.choice("etaoinshrdlu") for _ in range(rng.randint(1, 5))) for _ in range(words)) + "."


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[{"role": "user", "content": sentence(rng, rng.randint(2, 5))},
             {"role": "assistant", "content": sentence(rng, rng.randint(6, 14))}] for _ in range(n)]


def write_sharegpt(path, convs) -> str:
    records = [{"id": str(i), "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in conv]}
        for i, conv in enumerate(convs)]
    path.write_text(json.dumps(records, indent=1))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target_model():
    return make_model("llama", seed=1, vocab=48, layers=4)


@pytest.fixture()
def data_file(tmp_path):
    return write_sharegpt(tmp_path / "data.json", conversations(40))


def config(tmp_path, data_file, kind="eagle1", **kw) -> TrainConfig:
    values = dict(kind=kind, data=[data_file], out=str(tmp_path / f"run-{kind}"), model="tiny", batch_size=4,
                  lr=3e-3, warmup_steps=2, eval_size=4, eval_every=0, save_every=0, log_every=1, ttt_steps=3,
                  eval_steps=3, draft_vocab_size=24, max_length=256)
    values.update(kw)
    return TrainConfig(**values)


# ---- data ------------------------------------------------------------------------------------------------
def test_sharegpt_parser_keeps_complete_conversations_of_truncated_file(tmp_path):
    path = tmp_path / "cut.json"
    write_sharegpt(path, conversations(5))
    text = path.read_text()
    cut = text.rfind('"value"')  # in the middle of the last conversation
    path.write_text(text[:cut + 12])
    convs = read_conversations(path)
    assert len(convs) == 4
    assert convs[:4] == conversations(5)[:4]  # roles normalised to user / assistant, content intact

    jsonl = tmp_path / "cut.jsonl"
    lines = [json.dumps({"messages": c}) for c in conversations(3)]
    jsonl.write_text("\n".join(lines)[:-20])  # truncated last line
    assert read_conversations(jsonl) == conversations(3)[:2]


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    conv = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok."},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    ex = encode_conversation(tok, conv)
    masked = tok.decode(ex.input_ids[ex.loss_mask].tolist())
    assert masked == "ok.<|im_end|>\nsure<|im_end|>\n"
    assert ex.input_ids.tolist() == tok(tok.apply_chat_template(conv, tokenize=False),
                                        add_special_tokens=False)["input_ids"]


def test_empty_dataset_and_no_assistant_turns_are_clear_errors(tok, tmp_path):
    with pytest.raises(EagleSpecError, match="empty"):
        encode_dataset(tok, [])
    with pytest.raises(EagleSpecError, match="no assistant turn|none of the"):
        encode_dataset(tok, [[{"role": "user", "content": "hello"}]] * 3)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(EagleSpecError, match="no conversations"):
        read_conversations(empty)


def test_self_distillation_writes_jsonl_and_resumes(tok, target_model, tmp_path):
    prompts = [c[:1] for c in conversations(5, seed=3)]
    out = tmp_path / "answers.jsonl"
    assert self_distill(transformers_generator(target_model, tok), tok, prompts[:3], out, batch_size=2,
                        max_new_tokens=6, progress=False) == 3
    first = out.read_text().splitlines()
    assert self_distill(transformers_generator(target_model, tok), tok, prompts, out, batch_size=2,
                        max_new_tokens=6, progress=False) == 5
    lines = out.read_text().splitlines()
    assert lines[:3] == first  # answered prompts are kept, not redone
    records = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in records) == ["0", "1", "2", "3", "4"]
    convs = read_conversations(out)
    assert all(c[-1]["role"] == "assistant" for c in convs)
    # The answer is the target's own greedy continuation of the templated prompt.
    r = records[0]
    ids = tok.apply_chat_template(prompts[int(r["id"])], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    want = target_model.generate(ids, do_sample=False, max_new_tokens=6,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
    assert r["conversations"][-1]["value"] == tok.decode(want, skip_special_tokens=True).strip()


# ---- head training forward matches inference -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_unrolled_steps_match_tree_drafting(target_model, kind):
    target = TargetModel(target_model, feature_kind="eagle3" if kind == "eagle3" else "final")
    torch.manual_seed(0)
    head = build_head(HeadConfig.for_target(target, kind, draft_vocab_size=20 if kind == "eagle3" else None)).eval()
    if kind == "eagle3":
        head.set_vocab(torch.arange(0, 40, 2))
    head.to(target.device)
    ids = torch.randint(3, 48, (1, 10), device=target.device)
    _, feats = target.features_for_batch(ids)
    emb = target.embed_tokens(ids)  # [1, T, d]
    nxt = torch.cat([emb[:, 1:], torch.zeros_like(emb[:, :1])], 1)
    with torch.no_grad():
        outs = head.unroll(head.lift(feats), nxt, 3)
        t = 5  # slot: the prefix is positions 0..t, drafted nodes at t+1, t+2 read x_{t+2}, x_{t+3}
        cache = KVCache()
        dev = target.device
        h = head.step(head.lift(feats[0, : t + 1]), emb[0, 1 : t + 2], torch.arange(t + 1, device=dev), cache,
                      torch.ones(t + 1, t + 1, dtype=torch.bool, device=dev).tril())
        assert torch.allclose(h, outs[0][0, : t + 1], atol=1e-5)
        hidden = h[-1:]
        for j in (1, 2):
            node = head.step(hidden, emb[0, t + 1 + j : t + 2 + j], torch.tensor([t + j], device=dev), cache,
                             torch.ones(1, len(cache) + 1, dtype=torch.bool, device=dev))
            assert torch.allclose(node[0], outs[j][0, t], atol=1e-5), j
            hidden = node


# ---- training ----------------------------------------------------------------------------------------------
def entropy_floor(trainer: Trainer, batch) -> float:
    """The lowest value the soft cross-entropy part of the loss can reach: the target distributions' entropy."""
    from eaglespec.train.losses import shift_left, step_mask

    head, target = trainer.unwrapped(), trainer.target
    steps = trainer.config.unroll_steps()
    vocab = (head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=target.device))
             if trainer.config.kind == "eagle3" else None)
    batch = batch.to(target.device)
    floor = 0.0
    for j in range(steps):
        logits = target.logits_from_last(shift_left(batch.last, 1 + j)[step_mask(batch, j)], vocab)
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
        floor += 0.8**j * (1.0 if trainer.config.kind == "eagle3" else trainer.config.ce_weight) * float(entropy)
    return floor


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_few_steps_reduce_the_loss(tmp_path, data_file, target_model, tok, kind):
    trainer = Trainer(config(tmp_path, data_file, kind, max_steps=30), target_model, tok, progress=False)
    batch = trainer.train_source.batch(list(range(8)))
    floor = entropy_floor(trainer, batch)
    with torch.no_grad():
        before = float(trainer.loss(batch).total) - floor
    acc_before = trainer.evaluate()["acc"][0]
    trainer.train()
    with torch.no_grad():
        after = float(trainer.loss(batch).total) - floor
    assert 0 < after < 0.7 * before, (before, after)
    log = [json.loads(line) for line in (tmp_path / f"run-{kind}" / "eval.jsonl").read_text().splitlines()]
    assert len(log[-1]["acc"]) == 3 and log[-1]["acc"][0] >= acc_before
    head = load_head(tmp_path / f"run-{kind}" / "head")
    assert head.config.kind == kind
    if kind == "eagle1":  # the token ranking for drafting over a subset, most frequent answer tokens first
        ranked, default = read_draft_vocab(tmp_path / f"run-{kind}" / "head")
        counts = token_counts(trainer.train_examples, 48)
        assert default == 24 and head.draft_vocab_size == 24
        assert counts[ranked[:-1]].tolist() == sorted(counts[ranked[:-1]].tolist(), reverse=True)
        assert set(head.vocab_ids.tolist()) == set(ranked[:24].tolist())


def test_resume_continues_at_the_same_step_and_data_position(tmp_path, data_file, target_model, tok):
    full = Trainer(config(tmp_path / "a", data_file, "eagle1", max_steps=12, save_every=4, epochs=2),
                   target_model, tok, progress=False)
    assert full.steps_per_epoch == 9  # 36 training conversations / 4: the run crosses an epoch boundary
    full.train()

    cfg = config(tmp_path / "b", data_file, "eagle1", max_steps=12, save_every=4, epochs=2)
    first = Trainer(cfg, target_model, tok, progress=False)
    first.train(stop_after=10)  # killed after step 10; the last checkpoint is step 8
    resumed = Trainer(cfg, target_model, tok, progress=False)
    resumed.resume()
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (8, 0, 8)
    resumed.train()
    assert (resumed.step, resumed.epoch, resumed.batch_in_epoch) == (full.step, full.epoch, full.batch_in_epoch)
    for (name, a), (_, b) in zip(full.unwrapped().state_dict().items(), resumed.unwrapped().state_dict().items()):
        assert torch.equal(a, b), name
    logs = [(tmp_path / d / "run-eagle1" / "train_log.jsonl").read_text().splitlines() for d in ("a", "b")]
    assert [json.loads(x)["loss"] for x in logs[0]] == [json.loads(x)["loss"] for x in logs[1][:8] + logs[1][10:]]


def test_resume_refuses_changed_settings_and_corrupt_state(tmp_path, data_file, target_model, tok):
    cfg = config(tmp_path, data_file, "eagle3", max_steps=2, save_every=2)
    Trainer(cfg, target_model, tok, progress=False).train()
    other = Trainer(config(tmp_path, data_file, "eagle3", max_steps=2, save_every=2, lr=1e-2), target_model, tok,
                    progress=False)
    with pytest.raises(CheckpointError, match="lr"):
        other.resume()
    ckpt = tmp_path / "run-eagle3" / "checkpoints" / "step-0000002"
    (ckpt / "state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        Trainer(cfg, target_model, tok, progress=False).resume()
    (ckpt / "head" / "model.safetensors").write_bytes(b"\x00" * 50)
    with pytest.raises(CheckpointError, match="corrupt"):
        Trainer(cfg, target_model, tok, progress=False).resume()
    with pytest.raises(EagleSpecError, match="no checkpoint"):
        Trainer(config(tmp_path / "fresh", data_file, "eagle3"), target_model, tok, progress=False).resume()


def test_held_out_conversations_stay_held_out_as_the_data_grows(tmp_path, target_model, tok):
    convs = conversations(60, seed=3)
    small = encode_dataset(tok, convs[:40], 256)
    grown = encode_dataset(tok, convs, 256)  # 20 conversations appended
    train_small, held_small = split_indices(small, 6, seed=0)
    train_grown, held_grown = split_indices(grown, 6, seed=0)
    assert len(held_small) == len(held_grown) == 6 and sorted(train_small + held_small) == list(range(40))
    # Nothing a head trained on the first 40 saw is held out of the 60: only held-out or new conversations are.
    assert set(held_grown) <= set(held_small) | set(range(40, 60))
    assert split_indices(grown, 6, seed=0) == (train_grown, held_grown)  # deterministic
    assert split_indices(grown, 6, seed=1)[1] != held_grown

    # --eval-data: every conversation of those files is held out, every --data one trains.
    train_file = write_sharegpt(tmp_path / "train.json", convs[:40])
    eval_file = write_sharegpt(tmp_path / "held.json", convs[40:45])
    trainer = Trainer(config(tmp_path, train_file, "eagle3", eval_data=[eval_file], eval_size=8, max_steps=2,
                             save_every=2), target_model, tok, progress=False)
    assert len(trainer.train_examples) == 40 and len(trainer.eval_examples) == 5
    assert [ex.input_ids.tolist() for ex in trainer.eval_examples] == [ex.input_ids.tolist() for ex in grown[40:45]]
    trainer.train()
    resumed = Trainer(config(tmp_path, train_file, "eagle3", eval_data=None, eval_size=8, max_steps=2,
                             save_every=2), target_model, tok, progress=False)
    with pytest.raises(CheckpointError, match="eval_data"):
        resumed.resume()
    # A checkpoint from before --eval-data existed drew another split: resuming it is refused, --init-head named.
    ckpt = tmp_path / "run-eagle3" / "checkpoints" / "step-0000002"
    saved = json.loads((ckpt / "train_config.json").read_text())
    del saved["eval_data"]
    (ckpt / "train_config.json").write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="--init-head"):
        resumed.resume()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_init_head_starts_from_a_trained_head_with_a_fresh_schedule(tmp_path, data_file, target_model, tok, kind):
    trained = trained_head(tmp_path / "first", data_file, target_model, tok, kind)
    save_head(trained, tmp_path / "trained", dtype=torch.float32)
    cfg = config(tmp_path / "second", data_file, kind, max_steps=4, init_head=str(tmp_path / "trained"))
    again = Trainer(cfg, target_model, tok, progress=False)
    assert again.step == 0 and again.scheduler.get_last_lr()[0] < cfg.lr  # warm-up starts afresh
    start = {k: v.clone() for k, v in again.unwrapped().state_dict().items()}
    for key, value in trained.state_dict().items():
        assert torch.equal(start[key], value), key
    fresh = Trainer(config(tmp_path / "fresh", data_file, kind, max_steps=4), target_model, tok, progress=False)
    batch = again.train_source.batch(list(range(8)))
    with torch.no_grad():
        assert float(again.loss(batch).total) < float(fresh.loss(batch).total)
    again.train()
    moved = again.unwrapped().state_dict()
    assert any(not torch.equal(moved[k], start[k]) for k in start if k != "vocab_ids")
    with pytest.raises(EagleSpecError, match="--kind"):
        Trainer(config(tmp_path / "x", data_file, "eagle3" if kind == "eagle1" else "eagle1",
                       init_head=str(tmp_path / "trained")), target_model, tok, progress=False)
    if kind == "eagle3":
        with pytest.raises(EagleSpecError, match="--draft-vocab-size 24, or --reselect-vocab"):
            Trainer(config(tmp_path / "y", data_file, kind, draft_vocab_size=16, init_head=str(tmp_path / "trained")),
                    target_model, tok, progress=False)


def test_reselect_vocab_rechooses_an_eagle3_heads_draft_vocabulary_and_keeps_its_trained_rows(
        tmp_path, data_file, target_model, tok):
    trained = trained_head(tmp_path / "first", data_file, target_model, tok, "eagle3")  # 24 draft tokens
    save_head(trained, tmp_path / "trained", dtype=torch.float32)
    other_data = write_sharegpt(tmp_path / "other.json", conversations(40, seed=7))
    cfg = config(tmp_path / "second", other_data, "eagle3", max_steps=3, draft_vocab_size=16,
                 init_head=str(tmp_path / "trained"), reselect_vocab=True)
    again = Trainer(cfg, target_model, tok, progress=False)
    head = again.unwrapped()
    expected = select_draft_vocab(token_counts(again.train_examples, 48), 16)
    draft = torch.arange(16, device=head.d2t.device)  # (the trainer's device)
    assert torch.equal(head.to_target_ids(draft).cpu(), expected)  # target = draft + d2t[draft]
    assert torch.equal(head.t2d.nonzero()[:, 0].cpu(), expected)  # t2d marks exactly those ids
    old = trained.to_target_ids(torch.arange(24, device=head.d2t.device)).tolist()
    kept = [i for i, t in enumerate(expected.tolist()) if t in old]
    assert 0 < len(kept) <= 16
    for i in kept:
        assert torch.equal(head.lm_head.weight[i], trained.lm_head.weight[old.index(int(expected[i]))])
    for key, value in trained.state_dict().items():
        if key not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(head.state_dict()[key], value), key
    batch = again.train_source.batch(list(range(4)))
    assert torch.isfinite(again.loss(batch).total)
    again.train()
    assert load_head(tmp_path / "second" / "run-eagle3" / "head").config.draft_vocab_size == 16


def test_training_on_data_without_answers_is_a_clear_error(tmp_path, target_model, tok):
    path = tmp_path / "q.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hello"}]}] * 4))
    with pytest.raises(EagleSpecError, match="assistant turn"):
        Trainer(config(tmp_path, str(path)), target_model, tok, progress=False)


def test_cached_features_equal_online_features(tmp_path, data_file, target_model, tok, capsys):
    target = TargetModel(target_model, feature_kind="eagle3")
    examples = encode_dataset(tok, read_conversations(data_file))[:10]
    online = OnlineFeatures(target, examples)
    stores = open_feature_stores(target, [examples[:4], examples[4:]], tmp_path / "cache", "tiny", batch_size=3,
                                 dtype=torch.float32, progress=False)
    assert "10 conversations to compute" in capsys.readouterr().err
    cached = CachedFeatures([(stores[0], j) for j in range(4)] + [(stores[1], j) for j in range(6)])
    a, b = online.batch([3, 7, 1]).to("cpu"), cached.batch([3, 7, 1]).to("cpu")
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    real = a.attention_mask
    assert torch.allclose(a.last[real], b.last[real], atol=1e-5)
    assert torch.allclose(a.features[real], b.features[real], atol=1e-5)


def test_bfloat16_features_are_computed_under_autocast_and_cached_apart(tmp_path, data_file, target_model, tok, capsys):
    """--feature-dtype bfloat16: the float32 target's products run in bfloat16 (close to, not equal to, float32
    features), the weights stay float32, and the store is a different one from the float32 features'."""
    target = TargetModel(target_model, feature_kind="eagle3")
    examples = encode_dataset(tok, read_conversations(data_file))[:4]
    ids, _, attn = pad_examples(examples)
    last32, feats32 = target.features_for_batch(ids, attn.long())
    last16, feats16 = target.features_for_batch(ids, attn.long(), torch.bfloat16)
    real = attn.bool()
    assert feats16.dtype == torch.float32 and next(target_model.parameters()).dtype == torch.float32
    assert not torch.equal(feats16[real], feats32[real])
    scale = feats32[real].abs().max()
    assert (feats16[real] - feats32[real]).abs().max() < 0.05 * scale
    assert torch.equal(last16, target.features_for_batch(ids, attn.long(), torch.bfloat16)[0])  # deterministic
    root = tmp_path / "cache"
    [f32] = open_feature_stores(target, [examples], root, "tiny", progress=False)
    [b16] = open_feature_stores(target, [examples], root, "tiny", progress=False, compute_dtype=torch.bfloat16)
    assert capsys.readouterr().err.count("4 conversations to compute") == 2
    assert f32.folder != b16.folder
    assert '"computed_in": "torch.bfloat16"' in (b16.folder / "meta.json").read_text()
    n = examples[1].input_ids.numel()
    assert torch.equal(b16.rows(1)[1], feats16[1, :n].to(torch.bfloat16))
    trainer = Trainer(config(tmp_path, data_file, kind="eagle3", cache_features=str(root), feature_dtype="bfloat16"),
                      target_model, tok, progress=False)
    store = trainer.train_source.refs[0][0]
    assert '"computed_in": "torch.bfloat16"' in (store.folder / "meta.json").read_text()
    with pytest.raises(EagleSpecError, match="--feature-dtype"):
        Trainer(config(tmp_path, data_file, feature_dtype="float16"), target_model, tok, progress=False)


@pytest.mark.skipif(not bf16gemm.available(torch.bfloat16, "cpu"),
                    reason="the fast path's row-invariant kernels need AVX-512 BF16 or AVX2 + FMA and a C++ compiler")
def test_fast_path_features_are_the_rows_decoding_reads(tmp_path, data_file, target_model, tok, capsys):
    """--feature-path fast: a training sequence's features and last rows are bit for bit those decoding computes
    (a prompt, then one-token steps: what a draft head reads), across the 512-row pieces too; the target's own cache
    is untouched; the trainer computes them from a bfloat16 copy into a store of their own and trains on them."""
    model = make_model("llama", seed=3, vocab=48, layers=3, max_position_embeddings=1100).to(torch.bfloat16)
    fast = make_target(model, feature_kind="eagle3", backend="fast")
    assert fast.kernel_stack is not None or fast.tree_kernel
    ids = torch.randint(0, 48, (2, 600), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, 600, dtype=torch.long)
    attn[1, 530:] = 0
    fast.reset()
    fast.forward(ids[0, :5])
    fast.commit()
    cache = fast.values[:, :, :5].clone()
    last, feats = fast.features_for_batch(ids, attn)
    assert fast.cache_len == 5 and torch.equal(fast.values[:, :, :5], cache)
    assert feats.shape == (2, 600, 3 * 64) and last.shape == (2, 600, 64) and feats.dtype == torch.bfloat16
    assert not feats[1, 530:].any() and not last[1, 530:].any() and feats[1, :530].abs().sum() > 0
    fast.reset()
    prompt = fast.forward(ids[0, :7])  # decoding: the prompt, then one token a step
    fast.commit()
    rows = [(prompt.last, prompt.features)]
    for i in range(7, 24):
        out = fast.forward(ids[0, i : i + 1])
        fast.commit()
        rows.append((out.last, out.features))
    assert torch.equal(torch.cat([r[0] for r in rows]), last[0, :24])
    assert torch.equal(torch.cat([r[1] for r in rows]), feats[0, :24])
    fast.reset()
    whole = fast.forward(ids[0])  # 600 rows: read in pieces as a long prompt is
    fast.commit()
    assert torch.equal(whole.features, feats[0]) and torch.equal(whole.last, last[0])
    with pytest.raises(EagleSpecError, match="compute dtype"):
        fast.features_for_batch(ids, attn, torch.float32)

    root = tmp_path / "cache"
    trainer = Trainer(config(tmp_path, data_file, kind="eagle3", cache_features=str(root), feature_path="fast",
                             max_steps=2), target_model, tok, progress=False)
    assert next(target_model.parameters()).dtype == torch.float32  # (a copy: the labels' model stays float32)
    store = trainer.train_source.refs[0][0]
    assert '"computed_in": "torch.bfloat16"' in (store.folder / "meta.json").read_text()
    ex = store.examples[0]
    fast16 = make_target(copy.deepcopy(target_model).to(torch.bfloat16), feature_kind="eagle3", backend="fast")
    assert isinstance(fast16, FastTarget)
    want_last, want = fast16.features_for_batch(ex.input_ids[None])
    assert torch.equal(store.rows(0)[1], want[0]) and torch.equal(store.rows(0)[0], want_last[0])
    [model_store] = open_feature_stores(TargetModel(target_model, feature_kind="eagle3"), [store.examples], root,
                                        "tiny", progress=False)
    assert model_store.folder != store.folder  # the model's features are another store
    trainer.train()
    assert (tmp_path / "run-eagle3" / "head" / "config.json").is_file()
    with pytest.raises(EagleSpecError, match="--feature-dtype applies"):
        Trainer(config(tmp_path, data_file, feature_path="fast", feature_dtype="bfloat16"), target_model, tok,
                progress=False)
    with pytest.raises(EagleSpecError, match="--feature-path"):
        Trainer(config(tmp_path, data_file, feature_path="gpu"), target_model, tok, progress=False)
    with pytest.raises(EagleSpecError, match="--activations int8"):  # (asked for, it reaches the fast target)
        Trainer(config(tmp_path, data_file, feature_path="fast", activations="int8"), target_model, tok,
                progress=False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: a tied LM head and a scaled embedding
def test_float32_ends_come_from_the_checkpoint_not_the_bfloat16_rounding(tmp_path, tok, arch):
    from eaglespec.models import load_target
    from eaglespec.targets import source

    model = make_model(arch, seed=4, vocab=48, layers=2)  # float32
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    b16, _ = load_target(str(tmp_path / "tiny"), dtype="bfloat16", one_copy=True)
    ends = TargetModel(b16).ends().in_float32(lambda weight: source.stored_copy(b16, weight))
    assert ends.dtype == torch.float32 and ends.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(ends.lm_head.weight, model.get_output_embeddings().weight)  # the stored float32 values
    assert torch.equal(ends.embed_tokens.weight, model.get_input_embeddings().weight)
    assert not torch.equal(ends.lm_head.weight, b16.get_output_embeddings().weight.float())  # not the rounding
    assert (ends.lm_head.weight is ends.embed_tokens.weight) == (arch == "gemma3")  # tied stays tied
    assert b16.get_output_embeddings().weight.dtype == torch.bfloat16  # the model itself is left as it was
    ids = torch.tensor([[1, 5, 7]])
    assert torch.equal(ends.embed_tokens(ids), model.get_input_embeddings()(ids))  # (gemma3: its scale too)
    last = torch.randn(3, 64)
    assert torch.equal(ends.logits_from_last(last), TargetModel(model).logits_from_last(last))
    upcast = TargetModel(copy.deepcopy(model).to(torch.bfloat16)).ends().in_float32()  # no checkpoint: upcast
    assert torch.equal(upcast.lm_head.weight, model.get_output_embeddings().weight.to(torch.bfloat16).float())
    assert TargetModel(model).ends().in_float32().lm_head is model.get_output_embeddings()  # float32 already


@pytest.mark.skipif(not bf16gemm.available(torch.bfloat16, "cpu"),
                    reason="the fast path's row-invariant kernels need AVX-512 BF16 or AVX2 + FMA and a C++ compiler")
def test_fast_path_training_holds_the_target_once(tmp_path, data_file, tok):
    """`train head --feature-path fast` loads the target once, in bfloat16, for the features, and the losses read
    float32 copies of its embedding and LM head from the checkpoint: the same head and losses as the float32 model
    beside a bfloat16 copy, as before."""
    from eaglespec.models import load_target

    model = make_model("llama", seed=5, vocab=48, layers=2)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    b16, _ = load_target(str(tmp_path / "tiny"), dtype="bfloat16", one_copy=True)
    once = Trainer(config(tmp_path / "once", data_file, kind="eagle3", feature_path="fast", max_steps=2), b16, tok,
                   progress=False, feature_model=b16)
    two = Trainer(config(tmp_path / "two", data_file, kind="eagle3", feature_path="fast", max_steps=2), model, tok,
                  progress=False, feature_model=load_target(str(tmp_path / "tiny"), dtype="bfloat16")[0])
    assert once.ends.lm_head.weight.dtype == torch.float32
    assert torch.equal(once.ends.lm_head.weight, two.ends.lm_head.weight)
    for a, b in zip(once.unwrapped().state_dict().values(), two.unwrapped().state_dict().values()):
        assert torch.equal(a, b)  # the same initial head (its LM head rows from the float32 ends)
    batch = once.train_source.batch([0, 1, 2])
    assert torch.equal(batch.features, two.train_source.batch([0, 1, 2]).features)
    assert torch.equal(once.loss(batch).total, two.loss(batch).total)
    once.train()
    assert (tmp_path / "once" / "run-eagle3" / "head" / "config.json").is_file()


def test_feature_cache_keeps_one_store_per_file_and_reuses_it(tmp_path, target_model, tok, capsys):
    """A second run with one more data file computes only that file's features; EAGLE-1 reads the EAGLE-3 store;
    the trainer reuses the stores whatever its split; a corrupt shard is a clear error."""
    files = [write_sharegpt(tmp_path / "a.json", conversations(5, seed=1)),
             write_sharegpt(tmp_path / "b.json", conversations(4, seed=2))]
    first, second = (encode_dataset(tok, read_conversations(f), 256) for f in files)
    fused = TargetModel(target_model, feature_kind="eagle3")
    root = tmp_path / "cache"
    open_feature_stores(fused, [first], root, "tiny", progress=False)
    assert "5 conversations to compute" in capsys.readouterr().err
    [folder] = list(root.iterdir())
    shard = folder / "shard-00000.safetensors"
    written = shard.stat().st_mtime_ns
    stores = open_feature_stores(fused, [first, second], root, "tiny", progress=False)
    assert "4 conversations to compute" in capsys.readouterr().err
    assert shard.stat().st_mtime_ns == written and len(list(root.iterdir())) == 2
    again = open_feature_stores(TargetModel(target_model, feature_kind="final"), [first, second], root, "tiny",
                                progress=False)
    assert capsys.readouterr().err == ""  # nothing computed: EAGLE-1 takes the "last" rows of the EAGLE-3 stores
    assert again[0].folder == stores[0].folder
    assert torch.equal(again[0].rows(1)[1], again[0].rows(1)[0])  # EAGLE-1's input features are the last rows
    assert torch.equal(again[1].rows(2)[1], stores[1].rows(2)[0])
    trainer = Trainer(config(tmp_path, files[0], data=files, kind="eagle3", cache_features=str(root), eval_size=3),
                      target_model, tok, progress=False)
    assert "to compute" not in capsys.readouterr().err
    source = trainer.train_source
    batch = source.batch([0, 5])
    for row, i in enumerate((0, 5)):  # each training example is served from its own file's store
        store, j = source.refs[i]
        assert store.examples[j] is trainer.train_examples[i] and store.folder.parent == root
        n = trainer.train_examples[i].input_ids.numel()
        assert torch.equal(batch.features[row, :n], store.rows(j)[1].float())
    shard.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="corrupt"):
        open_feature_stores(fused, [first], root, "tiny", progress=False)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_with_cached_features_the_trainer_lets_the_decoder_layers_go(tmp_path, data_file, tok, kind):
    """Once every feature is on disk the losses read only the target's embedding and LM head: the trainer keeps no
    reference to the decoder layers, so they are freed when the caller drops the model (as the CLI does), and
    training and held-out evaluation run on, the same as with the whole model kept."""
    model = make_model("llama", seed=5, vocab=48, layers=2)
    kept = copy.deepcopy(model)
    layer, embedding = weakref.ref(model.model.layers[0]), model.get_input_embeddings()
    cached = config(tmp_path, data_file, kind, cache_features=str(tmp_path / "cache"), max_steps=3)
    trainer = Trainer(cached, model, tok, progress=False)
    del model
    gc.collect()
    assert layer() is None
    assert trainer.target.embed_tokens is embedding and trainer.target.vocab_size == 48
    whole = Trainer(replace(cached, out=str(tmp_path / "whole")), kept, tok, progress=False)
    whole.target = TargetModel(kept, feature_kind="eagle3" if kind == "eagle3" else "final")  # the whole model
    batch = trainer.train_source.batch([0, 1, 2])
    assert torch.equal(trainer.loss(batch).total, whole.loss(batch).total)
    trainer.train()
    assert trainer.evaluate()["acc"][0] >= 0.0


def test_feature_shards_are_mapped_from_their_files_not_copied(tmp_path):
    """A store's shards are views of the files' pages (copy-on-write: writing to a view leaves the file as it was),
    equal to what safetensors reads; a truncated or foreign file is an error, not garbage rows."""
    tensors = {"last": torch.randn(7, 5).to(torch.bfloat16), "features": torch.randn(7, 15),
               "half": torch.randn(3, 2).to(torch.float16)}
    path = tmp_path / "shard.safetensors"
    save_file(tensors, str(path), metadata={"note": "kept"})
    mapped = map_safetensors(path)
    assert mapped.keys() == tensors.keys()
    for name, value in tensors.items():
        assert mapped[name].dtype == value.dtype and torch.equal(mapped[name], value)
        assert mapped[name].untyped_storage().nbytes() == path.stat().st_size  # one mapping of the whole file
    before = path.read_bytes()
    mapped["features"][0, 0] = 123.0
    assert path.read_bytes() == before and torch.equal(load_file(str(path))["features"], tensors["features"])
    path.write_bytes(before[: len(before) // 2])
    with pytest.raises(ValueError, match="outside the file"):
        map_safetensors(path)
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="header"):
        map_safetensors(path)
    header = b'{"last": 1}'
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(TypeError):  # (a store turns each of these into "missing or corrupt ... delete it to rebuild")
        map_safetensors(path)


# ---- checkpoints, vocabulary, export -------------------------------------------------------------------------
def trained_head(tmp_path, data_file, target_model, tok, kind):
    return Trainer(config(tmp_path, data_file, kind, max_steps=3), target_model, tok, progress=False).train()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, data_file, target_model, tok, kind):
    head = trained_head(tmp_path, data_file, target_model, tok, kind).eval()
    save_head(head, tmp_path / "saved")
    target = TargetModel(target_model, feature_kind="eagle3" if kind == "eagle3" else "final")
    loaded = load_head(tmp_path / "saved", device=target.device)
    ids = torch.randint(3, 48, (2, 12), device=target.device)
    _, feats = target.features_for_batch(ids)
    emb = target.embed_tokens(ids)
    with torch.no_grad():
        for a, b in zip(head.unroll(head.lift(feats), emb, 3), loaded.unroll(loaded.lift(feats), emb, 3)):
            assert torch.equal(a, b)
            assert torch.equal(head.logits(a, target.lm_head), loaded.logits(b, target.lm_head))


def test_a_narrower_mlp_is_recorded_in_the_config_and_survives_save_and_export(tmp_path, data_file, target_model, tok):
    head = Trainer(config(tmp_path, data_file, "eagle3", max_steps=2, intermediate_size=16), target_model, tok,
                   progress=False).train()
    assert target_model.config.intermediate_size != 16
    assert head.config.intermediate_size == 16 and head.midlayer.mlp.up_proj.weight.shape[0] == 16
    save_head(head, tmp_path / "ours")
    export_head(tmp_path / "ours", tmp_path / "official", layout="official", weights="safetensors")
    assert json.loads((tmp_path / "official" / "config.json").read_text())["intermediate_size"] == 16
    back = load_head(tmp_path / "official", device=next(head.parameters()).device)
    assert back.config.intermediate_size == 16
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_export_then_import_gives_identical_weights(tmp_path, data_file, target_model, tok, weights):
    head = trained_head(tmp_path, data_file, target_model, tok, "eagle3")
    save_head(head, tmp_path / "ours")
    export_head(tmp_path / "ours", tmp_path / "official", layout="official", weights=weights)
    official = json.loads((tmp_path / "official" / "config.json").read_text())
    assert official["architectures"] == ["LlamaForCausalLMEagle3"] and "eaglespec" not in official
    assert official["draft_vocab_size"] == 24
    export_head(tmp_path / "official", tmp_path / "back", layout="eaglespec")
    back = load_head(tmp_path / "back", device=next(head.parameters()).device)
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_official_eagle1_checkpoint_with_embeddings_imports(tmp_path, target_model):
    target = TargetModel(target_model)
    head = build_head(HeadConfig.for_target(target, "eagle1"))
    folder = tmp_path / "official-eagle1"
    folder.mkdir()
    state = dict(head.state_dict())
    state["embed_tokens.weight"] = target.embed_tokens.weight.clone()  # official EAGLE-1 files carry it
    torch.save(state, folder / "pytorch_model.bin")
    cfg = head.config.to_json()
    cfg.pop("eaglespec")
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_head(folder)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    state["fc.weight"] = state["fc.weight"][:, :10]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="shape"):
        load_head(folder)


def test_draft_vocabulary_maps_are_consistent(tok, tmp_path, data_file, target_model):
    examples = encode_dataset(tok, read_conversations(data_file))
    counts = token_counts(examples, 48)
    assert int(counts.sum()) == sum(int(e.loss_mask.sum()) for e in examples)
    ids = select_draft_vocab(counts, 24)
    chosen = set(ids.tolist())
    assert min(int(counts[i]) for i in chosen) >= max(int(counts[i]) for i in range(48) if i not in chosen)
    head = trained_head(tmp_path, data_file, target_model, tok, "eagle3").cpu()
    draft = torch.arange(24)
    target_ids = draft + head.d2t[draft]
    assert torch.equal(target_ids, head.to_target_ids(draft))
    assert torch.equal(torch.sort(target_ids).values, ids)
    assert head.t2d.sum() == 24 and head.t2d[target_ids].all()
    assert torch.equal(torch.nonzero(head.t2d).flatten(), target_ids)


# ---- command line --------------------------------------------------------------------------------------------
def test_cli_data_train_export(tmp_path, target_model, tok, capsys):
    from eaglespec.cli import main

    model_dir = tmp_path / "tiny-model"
    target_model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    source = write_sharegpt(tmp_path / "source.json", conversations(12, seed=5))
    answers = tmp_path / "answers.jsonl"
    assert main(["train", "data", "--model", str(model_dir), "--source", source, "--out", str(answers),
                 "--limit", "10", "--batch-size", "4", "--max-new-tokens", "8"]) == 0
    assert len(answers.read_text().splitlines()) == 10
    out = tmp_path / "run"
    assert main(["train", "head", "--model", str(model_dir), "--kind", "eagle3", "--data", str(answers),
                 "--out", str(out), "--max-steps", "3", "--batch-size", "2", "--eval-size", "2", "--draft-vocab-size",
                 "16", "--ttt-steps", "2", "--eval-steps", "2", "--cache-features", str(tmp_path / "cache"),
                 "--save-dtype", "bfloat16"]) == 0
    head = load_head(out / "head")
    assert head.config.draft_vocab_size == 16 and head.config.target["num_hidden_layers"] == 4
    last_eval = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert last_eval["step"] == 3
    # `train eval` on other conversations: the same accuracy function as during training, over the given data.
    held = write_sharegpt(tmp_path / "held.json", conversations(5, seed=9))
    assert main(["train", "eval", "--model", str(model_dir), "--head", str(out / "head"), "--data", held,
                 "--steps", "2", "--out", str(tmp_path / "acc.json")]) == 0
    result = json.loads((tmp_path / "acc.json").read_text())
    assert result["conversations"] == 5 and len(result["acc"]) == 2 and result["tokens"] > 0
    from eaglespec.train.evaluate import draft_accuracy

    direct_target = TargetModel(target_model, feature_kind="eagle3")
    examples = encode_dataset(tok, read_conversations(held), 1024)
    direct = draft_accuracy(head.float().to(direct_target.device), direct_target,
                            OnlineFeatures(direct_target, examples), list(range(5)), 2)
    assert result["acc"] == pytest.approx(direct["acc"]) and result["tokens"] == direct["tokens"]
    assert "5 conversations: acc@1=" in capsys.readouterr().out
    assert main(["export", str(out / "head"), str(tmp_path / "official"), "--weights", "bin"]) == 0
    assert (tmp_path / "official" / "pytorch_model.bin").is_file()
    # Errors are one line and exit code 2.
    capsys.readouterr()
    assert main(["train", "head", "--model", str(model_dir), "--data", str(tmp_path / "missing.json"),
                 "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_learning_rate_warms_up_then_decays_with_steps_or_time_budget():
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, 0.1) == pytest.approx(0.55)  # half way through the cosine
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    # A time budget half used at step 20 puts the schedule half way; used up, it is at the floor.
    assert lr_lambda(20, 10, 1000, 0.1, time_fraction=0.5) == pytest.approx(0.55)
    assert lr_lambda(20, 10, 1000, 0.1, time_fraction=1.0) == pytest.approx(0.1)
    assert lr_lambda(5, 10, 1000, 0.1, time_fraction=0.9) == pytest.approx(0.6)  # warmup is by steps


def test_eagle3_head_starts_from_the_target_readout(tmp_path, data_file, target_model, tok):
    trainer = Trainer(config(tmp_path, data_file, "eagle3", max_steps=1), target_model, tok, progress=False)
    head = trainer.unwrapped()
    ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=trainer.target.device))
    assert torch.equal(head.lm_head.weight, target_model.lm_head.weight[ids])
    assert torch.equal(head.norm.weight, target_model.model.norm.weight)


def test_eagle1_cross_entropy_over_the_draft_vocabulary(tmp_path, data_file, target_model, tok):
    """--ce-vocab draft scores the head over the subset it drafts from; over every token it is the full loss."""
    full = Trainer(config(tmp_path, data_file, "eagle1"), target_model, tok, progress=False)
    batch = full.train_source.batch(list(range(4)))
    everything = Trainer(config(tmp_path, data_file, "eagle1", ce_vocab="draft", draft_vocab_size=48),
                         target_model, tok, progress=False)
    everything.unwrapped().load_state_dict(full.unwrapped().state_dict())
    with torch.no_grad():
        a, b = full.loss(batch).parts, everything.loss(batch).parts
    assert a["soft_ce"] == pytest.approx(b["soft_ce"], rel=1e-5) and a["regression"] == b["regression"]

    subset = Trainer(config(tmp_path, data_file, "eagle1", ce_vocab="draft", max_steps=20), target_model, tok,
                     progress=False)
    assert subset.unwrapped().draft_vocab_size == 24
    with torch.no_grad():
        before = subset.loss(batch).parts["soft_ce"]
    subset.train()
    with torch.no_grad():
        assert subset.loss(batch).parts["soft_ce"] < before
    with pytest.raises(EagleSpecError, match="ce-vocab"):
        Trainer(config(tmp_path, data_file, "eagle1", ce_vocab="some"), target_model, tok, progress=False)


def test_eagle3_loss_is_the_weighted_sum_of_per_step_soft_cross_entropies(tmp_path, data_file, target_model, tok):
    """The trainer computes the target's distributions once and shifts them per step; the reference recomputes
    them at each step from the target's hidden states at positions t+1+j."""
    from eaglespec.train.losses import (
        next_embeds,
        shift_left,
        soft_cross_entropy,
        step_mask,
    )

    trainer = Trainer(config(tmp_path, data_file, "eagle3", ttt_steps=3), target_model, tok, progress=False)
    head, batch = trainer.unwrapped(), trainer.train_source.batch(list(range(6))).to(trainer.target.device)
    ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=trainer.target.device))
    with torch.no_grad():
        got = trainer.loss(batch)
        outs = head(batch.features.float(), next_embeds(target_model.get_input_embeddings(), batch), 3)
        want = 0.0
        for j, out in enumerate(outs):
            valid = step_mask(batch, j)
            p = torch.softmax(trainer.target.logits_from_last(shift_left(batch.last, 1 + j)[valid], ids), -1)
            ce = float(soft_cross_entropy(head.logits(out[valid], None), p))
            assert got.parts[f"ce{j}"] == pytest.approx(ce, rel=1e-5)
            want += 0.8**j * ce
    assert float(got.total) == pytest.approx(want, rel=1e-5)


def test_eagle1_training_time_test_scores_each_step_on_its_own_fed_back_output(tmp_path, data_file, target_model, tok):
    """EAGLE-1 with --ttt-steps k: step j reads the head's own step j-1 feature and is scored (SmoothL1 + 0.1 soft
    CE) against the target's feature and distribution at t+1+j, weighted 0.8^j; one step is the paper's loss."""
    import torch.nn.functional as F

    from eaglespec.train.losses import (
        next_embeds,
        shift_left,
        soft_cross_entropy,
        step_mask,
    )

    one = Trainer(config(tmp_path, data_file, "eagle1", ttt_steps=None, noise=0.0), target_model, tok, progress=False)
    three = Trainer(config(tmp_path, data_file, "eagle1", ttt_steps=3, noise=0.0, max_steps=25), target_model, tok,
                    progress=False)
    assert one.config.unroll_steps() == 1 and three.config.unroll_steps() == 3
    three.unwrapped().load_state_dict(one.unwrapped().state_dict())
    head, batch = one.unwrapped(), one.train_source.batch(list(range(6))).to(one.target.device)
    with torch.no_grad():
        got1, got3 = one.loss(batch), three.loss(batch)
        feats = batch.features.float()
        hidden, want, first = feats, 0.0, None
        for j in range(3):
            out = head(hidden, next_embeds(target_model.get_input_embeddings(), batch), j + 1)[j]
            valid = step_mask(batch, j)
            true = shift_left(batch.last, 1 + j)[valid].float()
            reg = float(F.smooth_l1_loss(out[valid], true))
            ce = float(soft_cross_entropy(target_model.lm_head(out[valid]),
                                          torch.softmax(target_model.lm_head(true), -1)))
            want += 0.8**j * (reg + 0.1 * ce)
            first = want if j == 0 else first
            suffix = str(j) if j else ""
            assert got3.parts[f"regression{suffix}"] == pytest.approx(reg, rel=1e-5)
            assert got3.parts[f"soft_ce{suffix}"] == pytest.approx(ce, rel=1e-5)
    assert float(got1.total) == pytest.approx(first, rel=1e-5) and set(got1.parts) == {"regression", "soft_ce"}
    assert float(got3.total) == pytest.approx(want, rel=1e-5)
    # Training lowers the deepest step's loss too (it learns to read its own features).
    before = got3.parts["regression2"]
    three.train()
    with torch.no_grad():
        assert three.loss(batch).parts["regression2"] < before


def test_two_processes_under_a_launcher(tmp_path, target_model, tok):
    # The same command in 2 CPU processes (torchrun: the launcher `accelerate launch` runs on GPUs; accelerate
    # reads either's environment, gloo on a CPU): the batches are split between the processes, the main one caches
    # the features while the other waits, the time budget is checked on a clock both agree on, one head is written.
    import os
    import subprocess
    import sys
    model_dir = tmp_path / "tiny-model"
    target_model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = write_sharegpt(tmp_path / "train.json", conversations(16, seed=3))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
               "-m", "eaglespec.cli", "train", "head",
               "--model", str(model_dir), "--kind", "eagle1", "--data", data, "--out", str(out), "--epochs", "2",
               "--batch-size", "2", "--eval-size", "2", "--eval-steps", "2", "--threads", "1", "--log-every", "1",
               "--cache-features", str(tmp_path / "cache"), "--time-budget", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path),
           "ACCELERATE_USE_CPU": "true",  # what `accelerate launch --cpu` sets: gloo across CPU processes
           "CUDA_VISIBLE_DEVICES": ""}  # (on a GPU machine too: accelerate would give each rank a GPU)
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    # 14 training conversations, 2 per process per step, 2 processes: 3 steps per epoch, 2 epochs.
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert load_head(out / "head").config.kind == "eagle1"
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one feature store, written once


def test_llamacpp_engine_without_its_package_names_the_pip_command(monkeypatch):
    import eaglespec.train.data as data
    from eaglespec.errors import MissingPackageError

    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="pip install llama-cpp-python"):
        data.llamacpp_generator("model.gguf", {0}, context=64)


def test_eaglespec_engine_answers_are_its_plain_decoding(tok, target_model, tmp_path):
    """train data --engine eaglespec: each answer is what eaglespec's plain decoding of that prompt alone writes
    (batched, the stop token dropped), and the records resume like any engine's."""
    engine = Engine.from_model(target_model, tok, head=None, method="vanilla")
    stop_ids = {tok.eos_token_id}
    generate = eaglespec_generator(engine, stop_ids, max_batch=3)
    prompts = [c[:1] for c in conversations(4, seed=5)]
    batch = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]
    batch = [ids["input_ids"] if hasattr(ids, "keys") else ids for ids in batch]
    answers = generate(batch, 7)
    for ids, answer in zip(batch, answers):
        alone = [t for t in engine.generate(ids, max_new_tokens=7).tokens]
        assert answer == (alone[:-1] if alone and alone[-1] in stop_ids else alone) and answer
    out = tmp_path / "answers.jsonl"
    assert self_distill(generate, tok, prompts, out, batch_size=2, max_new_tokens=7, progress=False) == 4
    record = json.loads(out.read_text().splitlines()[0])
    assert record["conversations"][-1]["value"] == tok.decode(answers[int(record["id"])]).strip()


def test_self_distillation_decodes_each_answer_of_any_engine(tok, tmp_path):
    # an engine is a function of (prompts' ids, max new tokens): answers come back in prompt order
    prompts = [c[:1] for c in conversations(3, seed=4)]
    word = tok.encode("hello", add_special_tokens=False)

    def engine(batch, max_new_tokens):
        assert max_new_tokens == 5 and all(isinstance(ids, list) and ids for ids in batch)
        return [word * (1 + len(ids) % 2) for ids in batch]

    out = tmp_path / "answers.jsonl"
    assert self_distill(engine, tok, prompts, out, batch_size=2, max_new_tokens=5, progress=False) == 3
    for record in map(json.loads, out.read_text().splitlines()):
        prompt = prompts[int(record["id"])]
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert record["conversations"][-1]["value"] == tok.decode(word * (1 + len(ids) % 2)).strip()
        assert record["conversations"][0]["value"] == prompt[0]["content"]
