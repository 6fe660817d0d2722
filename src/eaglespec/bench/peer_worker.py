"""A bench peer's engine in its own process and virtualenv, answering the bench over JSON lines.

Run by path with the peer's own python (never imported by eaglespec: it needs only the standard library and the
peer's packages, so it runs in a virtualenv without eaglespec or with another torch):

    PEER_PYTHON peer_worker.py '{"engine": "vllm", "model": DIR, "threads": 2, ...}'

It loads the model once and writes one line `{"event": "ready", "version": ..., "load_time": s, ...}` (or
`{"event": "error", "error": ...}` and exits 1). Then, for each request line on stdin

    {"op": "generate", "prompt_ids": [...], "max_new_tokens": N, "temperature": t, "top_p": p, "top_k": k,
     "seed": s, "stop_ids": [...]}

it answers `{"tokens": [...], "wall_time": s, "spec": {...} | null}` (wall time around the engine's call only;
"spec": the engine's own speculation counters for this call, where it has them), or `{"error": ...}`. EOF or
`{"op": "exit"}` ends it. The protocol uses a private copy of stdout; the process's stdout is pointed at stderr,
so whatever the engines print cannot break a line.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time
import traceback


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


class VllmEngine:
    """vLLM's offline `LLM` on a transformers folder; speculation through `speculative_config`."""

    def __init__(self, options: dict):
        # the engine core in this process (one process to measure), OpenMP threads on the first N cores
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        threads = int(options.get("threads") or 1)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", options.get("cpu_bind") or f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.get("kv_cache_gb", 1)))
        from vllm import LLM

        kwargs = dict(model=options["model"], dtype=options.get("dtype", "bfloat16"), skip_tokenizer_init=True,
                      max_model_len=int(options.get("max_model_len", 4096)), enable_prefix_caching=False,
                      disable_log_stats=False, seed=0)
        if options.get("speculative_config"):
            kwargs["speculative_config"] = options["speculative_config"]
        self.llm = LLM(**kwargs)
        self.info = {"version": _version("vllm-cpu") or _version("vllm"), "torch": _version("torch"),
                     "dtype": kwargs["dtype"], "cpu_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                     "kv_cache_gb": os.environ["VLLM_CPU_KVCACHE_SPACE"]}

    def _counters(self) -> dict:
        """vLLM's speculative-decoding counters so far (empty without speculation)."""
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted",
                 "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}
        out: dict = {}
        try:
            metrics = self.llm.get_metrics()
        except (AttributeError, AssertionError, RuntimeError):
            return out
        for metric in metrics:
            key = names.get(getattr(metric, "name", ""))
            if key == "accepted_per_pos":
                out[key] = [int(v) for v in getattr(metric, "values", [])]
            elif key:
                out[key] = int(getattr(metric, "value", 0))
        return out

    def generate(self, request: dict) -> dict:
        from vllm import SamplingParams

        greedy = request.get("temperature", 0.0) <= 0
        params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=0.0 if greedy else
                                request["temperature"], top_p=1.0 if greedy else request.get("top_p", 1.0),
                                top_k=-1 if greedy or not request.get("top_k") else request["top_k"],
                                seed=request.get("seed"), stop_token_ids=request.get("stop_ids") or None,
                                detokenize=False)
        before = self._counters()
        t0 = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": request["prompt_ids"]}], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = self._counters()
        spec = None
        if "drafts" in after:
            spec = {k: after[k] - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted") if k in after}
            if "accepted_per_pos" in after:
                old = before.get("accepted_per_pos") or [0] * len(after["accepted_per_pos"])
                spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], old)]
        return {"tokens": [int(t) for t in outputs[0].outputs[0].token_ids], "wall_time": wall, "spec": spec}


class OpenVinoEngine:
    """OpenVINO GenAI's `LLMPipeline` on an exported OpenVINO folder, with a draft model where given."""

    def __init__(self, options: dict):
        import openvino_genai

        self.genai = openvino_genai
        properties = {"INFERENCE_NUM_THREADS": int(options.get("threads") or 1)}
        if options.get("precision"):  # the computation's and the KV cache's (by default u8 on a CPU)
            properties["INFERENCE_PRECISION_HINT"] = options["precision"]
            properties["KV_CACHE_PRECISION"] = options["precision"]
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False  # every run pays its prefill, as the other methods do
        scheduler.cache_size = int(options.get("kv_cache_gb", 1))
        kwargs = dict(properties, scheduler_config=scheduler)
        if options.get("draft_model"):
            kwargs["draft_model"] = openvino_genai.draft_model(options["draft_model"], "CPU", **properties)
        self.pipe = openvino_genai.LLMPipeline(options["model"], "CPU", **kwargs)
        self.assistant_tokens = int(options.get("num_assistant_tokens") or 0) if options.get("draft_model") else 0
        self.info = {"version": _version("openvino-genai") or getattr(openvino_genai, "__version__", None),
                     "openvino": _version("openvino"), "precision": options.get("precision") or "default",
                     "kv_cache_precision": options.get("precision") or "default",
                     "threads": properties["INFERENCE_NUM_THREADS"]}

    def generate(self, request: dict) -> dict:
        import numpy as np
        import openvino

        config = self.genai.GenerationConfig()
        config.max_new_tokens = request["max_new_tokens"]
        if request.get("stop_ids"):
            config.stop_token_ids = set(request["stop_ids"])
        if request.get("temperature", 0.0) > 0:
            config.do_sample = True
            config.temperature = request["temperature"]
            config.top_p = request.get("top_p", 1.0)
            if request.get("top_k"):
                config.top_k = request["top_k"]
            if request.get("seed") is not None:
                config.rng_seed = request["seed"]
        else:
            config.do_sample = False
        if self.assistant_tokens:
            config.num_assistant_tokens = self.assistant_tokens
        ids = np.array([request["prompt_ids"]], dtype=np.int64)
        inputs = self.genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        wall = time.perf_counter() - t0
        return {"tokens": [int(t) for t in result.tokens[0]], "wall_time": wall, "spec": self._spec(result)}

    @staticmethod
    def _spec(result) -> dict | None:
        """A speculative call's counters, from its extended performance metrics: accepted and drafted tokens, and
        the target's inferences (one per verify step, the prefill included)."""
        metrics = getattr(result, "extended_perf_metrics", None)
        if metrics is None or not hasattr(metrics, "get_num_accepted_tokens"):
            return None
        try:
            spec = {"accepted": int(metrics.get_num_accepted_tokens()),
                    "draft_tokens": int(metrics.get_num_draft_tokens())}
            steps = list(metrics.main_model_metrics.raw_metrics.m_batch_sizes)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return None
        if steps:
            spec["target_forwards"] = len(steps)
        return spec


ENGINES = {"vllm": VllmEngine, "openvino": OpenVinoEngine}


def serve(options: dict, requests, replies) -> int:
    """Load the engine named in `options`, then answer `requests` (lines) on `replies` until EOF or exit."""

    def send(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    t0 = time.perf_counter()
    try:
        engine = ENGINES[options["engine"]](options)
    except Exception as exc:  # any failure to load is reported to the bench, which shows it
        traceback.print_exc(file=sys.stderr)
        send({"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    send({"event": "ready", "load_time": time.perf_counter() - t0, "pid": os.getpid(), **engine.info})
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "exit":
            break
        try:
            send(engine.generate(request))
        except Exception as exc:  # one failed request is an answer, not the end of the worker
            traceback.print_exc(file=sys.stderr)
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


def main(argv: list[str]) -> int:
    options = json.loads(argv[1])
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library prints go to stderr, not into the protocol
    return serve(options, sys.stdin, replies)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
