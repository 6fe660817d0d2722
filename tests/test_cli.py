"""The command line: it generates, and bad input gets a short message and exit code 2 (no traceback)."""

import pytest

from eaglespec.cli import main
from eaglespec.heads import HeadConfig, build_head, save_head
from eaglespec.target import TargetModel

from conftest import make_model
from tiny_hub import write_tiny_model


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
                         "--max-new-tokens", "12", "--total-tokens", "4", "--depth", "2", "--tree-top-k", "2")
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
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device", "cuda:7"], "CUDA GPU"),  # none here, or fewer than 8
])
def test_bad_options_exit_2_before_loading(capsys, argv, message):
    code, _, err = run(capsys, "generate", "hello", "--model", "/no/such/model", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_unknown_model_lists_known_names(capsys):
    code, _, err = run(capsys, "generate", "hello", "--model", "no-such-model")
    assert code == 2 and "smollm2-135m" in err


def test_empty_prompt(capsys, model_dir):
    code, _, err = run(capsys, "generate", "   ", "--model", str(model_dir))
    assert code == 2 and "empty" in err


def test_prompt_longer_than_context(capsys, model_dir):
    code, _, err = run(capsys, "generate", " ".join(["w7"] * 80), "--model", str(model_dir), "--raw",
                       "--max-new-tokens", "4")
    assert code == 2 and "context" in err


def test_unknown_method_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--method", "magic"])
    assert exc.value.code == 2


def test_head_for_another_model_is_refused(capsys, model_dir, tmp_path):
    other = TargetModel(make_model("llama", hidden_size=32, intermediate_size=64))
    wrong = save_head(build_head(HeadConfig.for_target(other, "eagle1")), tmp_path / "wrong")
    code, _, err = run(capsys, "generate", "w1", "--model", str(model_dir), "--head", str(wrong))
    assert code == 2 and "does not fit" in err and "hidden size 32" in err


def test_corrupt_head_weights(capsys, model_dir, head_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((head_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file at all")
    code, _, err = run(capsys, "generate", "w1", "--model", str(model_dir), "--head", str(bad))
    assert code == 2 and "corrupt" in err
