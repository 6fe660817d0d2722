"""The command line: it generates, and bad input gets a short message and exit code 2 (no traceback)."""

import pytest
from tiny_hub import write_tiny_model

from eaglespec.cli import main, parse_tree
from eaglespec.drafters import TreeSettings
from eaglespec.errors import EagleSpecError
from eaglespec.heads import HeadConfig, build_head, save_head
from eaglespec.targets.hf import TargetModel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, model_dir):
    from transformers import AutoModelForCausalLM

    target = TargetModel(AutoModelForCausalLM.from_pretrained(model_dir))
    return save_head(build_head(HeadConfig.for_target(target, "eagle1")), tmp_path_factory.mktemp("head") / "h")


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_streams_text_and_reports_speed(capsys, model_dir, head_dir):
    # Explicit tree settings: with `--tree auto` the method printed depends on this machine's timings.
    code, out, err = run(capsys, "generate", "w1 w2 w3", "--model", str(model_dir), "--head", str(head_dir),
                         "--max-new-tokens", "12", "--tree", "4,2,2")
    assert code == 0
    assert out.strip(), "the answer is printed"
    assert "tokens/s" in err and "tau" in err and "method eagle2" in err


def test_generate_without_head_falls_back_to_vanilla_with_a_note(capsys, model_dir):
    code, out, err = run(capsys, "generate", "w1 w2", "--model", str(model_dir), "--max-new-tokens", "5")
    assert code == 0
    assert "no trained draft head" in err and "method vanilla" in err


def test_raw_prompt_generates(capsys, model_dir):
    code, out, err = run(capsys, "generate", "w5", "--model", str(model_dir), "--raw", "--max-new-tokens", "3")
    assert code == 0 and out.strip() and "3 tokens" in err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--head", "/no/such/head"], "not a head folder"),
    (["--compile", "--quantize", "int8"], "not --quantize"),
    (["--backend", "hf", "--quantize", "int8"], "--quantize int8 needs eaglespec's fast path: drop --backend hf"),
    (["--backend", "hf", "--activations", "int8"], "--activations int8 needs eaglespec's fast path: drop --backend"),
    (["--backend", "hf", "--compile", "--exact"], "--exact and --compile need eaglespec's fast path"),
    (["--draft-model", "smollm2-135m"], "sps or staged: add one or drop --draft-model"),
    (["--method", "sps"], "--method sps needs --draft-model"),
    (["--method", "vanilla", "--head", "/no/such/head"], "--method vanilla drafts without a head: drop --head"),
    (["--method", "pld", "--head", "/no/such/head"], "drop --head"),
    (["--method", "sps", "--draft-model", "x", "--head", "/no/such/head"], "drop --head"),
    (["--method", "pld", "--draft-vocab", "100"], "drop --draft-vocab"),
    (["--method", "vanilla", "--tree", "16,5,4"], "drafts nothing: drop --tree 16,5,4"),
    (["--method", "vanilla", "--tree", "calibrate"], "drop --tree calibrate"),
    (["--method", "eagle1", "--tree", "16,5,4"], "static tree: drop --tree 16,5,4"),
    (["--method", "pld", "--tree", "calibrate"], "drop --tree calibrate"),
    (["--tree", "fixed"], "--tree takes auto, calibrate or TOTAL,DEPTH,TOP_K such as 16,5,4, got 'fixed'"),
    (["--tree", "16,5"], "--tree takes auto, calibrate or TOTAL,DEPTH,TOP_K"),
    (["--method", "vanilla", "--tree", "16,x,4"], "--tree takes auto"),  # malformed beats the combination
    (["--tree", "16,0,4"], "depth must be an integer between 1 and 1024"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "cuda:7"], "CUDA GPU"),  # none here, or fewer than 8
])
def test_bad_options_exit_2_before_loading(capsys, argv, message):
    code, _, err = run(capsys, "generate", "hello", "--model", "/no/such/model", *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text, tree", [
    ("auto", "auto"),
    ("calibrate", "calibrate"),
    ("16,5,4", TreeSettings(total_tokens=16, depth=5, top_k=4)),
    (" 6, 5 ,1 ", TreeSettings(total_tokens=6, depth=5, top_k=1)),  # a chain of 5 for chain / pld / sps
])
def test_tree_option_values(text, tree):
    assert parse_tree(text) == tree


@pytest.mark.parametrize("text", ["fixed", "", "16", "16,5", "16,5,4,2", "a,b,c", "16,-5,4", "16.0,5,4", "1,5,4"])
def test_malformed_tree_is_refused(text):
    with pytest.raises(EagleSpecError, match="--tree"):
        parse_tree(text)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"], ["bench"]])
@pytest.mark.parametrize("option", ["--total-tokens", "--depth", "--tree-top-k"])
def test_separate_tree_options_point_at_tree(capsys, command, option):
    with pytest.raises(SystemExit) as exc:
        main([*command, option, "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{option} is given within --tree TOTAL,DEPTH,TOP_K" in err
    assert len(err.strip().splitlines()) == 1, err


EVERYDAY = ["--model", "--head", "--method", "--draft-model", "--tree", "--max-new-tokens", "--temperature",
            "--top-p", "--top-k", "--seed", "--stop", "--system"]
ENGINE = ["--device", "--dtype", "--threads", "--backend", "--exact, --no-exact", "--compile", "--quantize",
          "--activations", "--ngram", "--extend", "--longest-chain", "--draft-vocab"]


def _help_sections(capsys, command: str) -> dict[str, list[str]]:
    """--help's option groups: title -> the options listed there, in order."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    sections: dict[str, list[str]] = {}
    title = None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title and line.startswith("  --"):
            sections[title].append(line.split(maxsplit=1)[0] if not line.startswith("  --exact,")
                                   else "--exact, --no-exact")
    return sections


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_help_puts_engine_switches_in_an_advanced_group(capsys, command):
    sections = _help_sections(capsys, command)
    everyday = sections["everyday options"]
    expected = EVERYDAY if command in ("generate", "chat", "bench") else EVERYDAY[:5]  # serve: no sampling options
    assert everyday == expected + (["--raw"] if command == "generate" else [])
    assert sections["engine options (advanced)"] == ENGINE
    listed = [option for options in sections.values() for option in options]
    assert not {"--total-tokens", "--depth", "--tree-top-k"} & set(listed)


def test_help_texts_are_short(capsys, monkeypatch):
    """In an 80-column terminal no option's help takes more than two lines."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_lines: dict[str, int] = {}
    option = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            option = line.split()[0]
            # argparse starts the help on the option's line where the option fits in the first 24 columns
            help_lines[option] = int(len(line) > 24 and line[:24].endswith("  "))
        elif option and line.startswith(" " * 24) and line.strip():
            help_lines[option] += 1
        else:
            option = None
    assert help_lines and {o: n for o, n in help_lines.items() if n > 2} == {}


@pytest.mark.parametrize("tree, base", [("8,3,2", {"total_tokens": 8, "depth": 3, "top_k": 2}), ("auto", "auto")])
def test_bench_sweep_takes_its_base_tree_from_tree(capsys, model_dir, head_dir, tmp_path, tree, base):
    """The swept setting varies; the others come from --tree, or TreeSettings' defaults under --tree auto."""
    import json

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "a", "turns": ["w1 w2 w3"]}\n')
    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "--model", str(model_dir), "--head", str(head_dir), "--head3", str(head_dir),
                       "--methods", "vanilla,eagle2", "--tree", tree, "--sweep", "total_tokens=4,6",
                       "--dataset", str(questions), "--repeats", "1", "--warmup", "0", "--max-new-tokens", "4",
                       "--out", str(out), "--no-progress")
    assert code == 0, err
    depth, top_k = (3, 2) if tree != "auto" else (5, 4)
    for total in (4, 6):
        tree_line = f"eagle2@total_tokens={total} tree {{'total_tokens': {total}, 'depth': {depth}, 'top_k': {top_k}}}"
        assert tree_line in err
    assert json.loads((out / "run.json").read_text())["settings"]["tree"] == base
