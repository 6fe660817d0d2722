"""Prometheus metrics of the server, named like vLLM's where an equivalent exists (`vllm:` -> `eaglespec:`).

Speculative decoding, counted per target verify forward as it happens (so cancelled requests count the work
they did):
  eaglespec:spec_decode_num_drafts_total          verify forwards that checked at least one drafted token
  eaglespec:spec_decode_num_draft_tokens_total    drafted tokens verified (tree nodes, root excluded)
  eaglespec:spec_decode_num_accepted_tokens_total drafted tokens the target accepted (bonus tokens excluded)
  eaglespec:spec_decode_num_accepted_tokens_per_pos_total{position}  accepted at tree depth position+1
  eaglespec:spec_decode_num_target_forwards_total all verify forwards (the prefill excluded)
  eaglespec:spec_decode_mean_accepted_length      tau = tokens emitted per verify forward, bonus included
Per tree depth, counted from the statistics of completed requests:
  eaglespec:spec_decode_num_drafts_per_pos_total{position}  verify forwards whose tree reached depth position+1
The acceptance rate at a depth is accepted_tokens_per_pos / drafts_per_pos.

Batched decoding (`--max-batch` above 1), per batched step:
  eaglespec:batch_size                            sequences in the last step's verify forward
  eaglespec:batch_steps_total                     batched steps
  eaglespec:batch_tokens_per_step                 tokens a step emitted, all its sequences together (histogram)
  eaglespec:batch_sequences_drafted_total         sequences that verified a draft tree in a step
  eaglespec:batch_sequences_plain_total           sequences that decoded one token without a draft in a step
  eaglespec:batch_rows_total                      rows the target verified in batched steps
  eaglespec:batch_prefill_rows_total              prompt rows read in batched steps (chunked prefill)
  eaglespec:prefix_cache_rows_total               prompt rows taken from the prefix cache instead of read
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..spec.decode import GenerationStats, Step

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
SPEED_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 250, 500, 1000)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


class ServerMetrics:
    """All metrics of one server, in their own registry (several servers can live in one process)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, p = self.registry, "eaglespec:"
        self.model_name = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, doc, labels + list(extra), registry=r)

        # Requests and their outcomes.
        self.requests = counter("requests", "Generation requests received", ("endpoint",))
        self.request_success = counter("request_success", "Requests that finished normally", ("finished_reason",))
        self.request_errors = counter("request_errors", "Requests answered with an error", ("endpoint", "code"))
        self.request_cancelled = counter("request_cancelled", "Requests whose client went away before the end")
        self.num_running = Gauge(p + "num_requests_running", "Requests being generated", labels, registry=r)
        self.num_waiting = Gauge(p + "num_requests_waiting", "Requests waiting in the queue", labels, registry=r)
        # Tokens.
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that were generated")
        self.generation_tokens = counter("generation_tokens", "Tokens generated (cancelled requests included)")
        self.tokens_per_s = Gauge(p + "generation_tokens_per_second",
                                  "Decoding speed of the most recently completed request", labels, registry=r)
        # Speculative decoding.
        self.num_drafts = counter("spec_decode_num_drafts", "Verify forwards that checked drafted tokens")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens verified by the target")
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted by the target")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted at tree depth position+1", ("position",))
        self.drafts_per_pos = counter("spec_decode_num_drafts_per_pos",
                                      "Verify forwards (completed requests) whose tree reached depth position+1",
                                      ("position",))
        self.num_forwards = counter("spec_decode_num_target_forwards", "Target verify forwards (prefill excluded)")
        self.mean_accepted_length = Gauge(p + "spec_decode_mean_accepted_length",
                                          "Tokens emitted per verify forward since start, bonus included (tau)",
                                          labels, registry=r)
        # Latencies.
        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(p + name, doc, labels, buckets=buckets, registry=r)

        self.e2e_latency = histogram("e2e_request_latency_seconds", "Time from arrival to the last token",
                                     LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time spent waiting in the queue", LATENCY_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token", LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Generation time per output token after the first",
                              TOKEN_TIME_BUCKETS)
        self.request_speed = histogram("request_generation_tokens_per_second", "Decoding speed per request",
                                       SPEED_BUCKETS)
        # Batched decoding.
        self.batch_size = Gauge(p + "batch_size", "Sequences in the last batched verify forward", labels, registry=r)
        self.batch_steps = counter("batch_steps", "Batched decoding steps")
        self.batch_tokens = histogram("batch_tokens_per_step", "Tokens a batched step emitted, all sequences "
                                      "together", STEP_TOKEN_BUCKETS)
        self.batch_drafted = counter("batch_sequences_drafted", "Sequences that verified a draft tree in a step")
        self.batch_plain = counter("batch_sequences_plain", "Sequences that decoded without a draft in a step")
        self.batch_rows = counter("batch_rows", "Rows the target verified in batched steps")
        self.batch_prefill_rows = counter("batch_prefill_rows", "Prompt rows read in batched steps (chunked prefill)")
        self.prefix_cache_rows = counter("prefix_cache_rows", "Prompt rows taken from the prefix cache instead of read")
        self._lock = threading.Lock()
        self._emitted = 0  # tokens emitted by verify forwards, for tau
        self._forwards = 0

    def _m(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    # ---- called by the HTTP layer ------------------------------------------------------------------------
    def request_received(self, endpoint: str) -> None:
        self._m(self.requests, endpoint=endpoint).inc()

    def request_failed(self, endpoint: str, status: int) -> None:
        self._m(self.request_errors, endpoint=endpoint, code=str(status)).inc()

    # ---- called by the generation worker -----------------------------------------------------------------
    def queue_sizes(self, waiting: int, running: int) -> None:
        self._m(self.num_waiting).set(waiting)
        self._m(self.num_running).set(running)

    def step(self, step: Step, is_prefill: bool) -> None:
        """One item of the engine's stream: the prefill's first token or one verify forward."""
        if step.tokens:
            self._m(self.generation_tokens).inc(len(step.tokens))
        if is_prefill:
            return
        drafted = step.tree_size - 1
        self._m(self.num_forwards).inc()
        if drafted > 0:
            self._m(self.num_drafts).inc()
            self._m(self.num_draft_tokens).inc(drafted)
        for pos in range(step.tree_depth):
            self._m(self.drafts_per_pos, position=str(pos)).inc()
        if step.accepted:
            self._m(self.num_accepted).inc(step.accepted)
            for pos in range(step.accepted):
                self._m(self.accepted_per_pos, position=str(pos)).inc()
        with self._lock:
            self._forwards += 1
            self._emitted += step.accepted + 1
            self._m(self.mean_accepted_length).set(self._emitted / self._forwards)

    def batch_step(self, report) -> None:
        """One step of the batch decoder (`spec.batch.StepReport`)."""
        self._m(self.batch_steps).inc()
        self._m(self.batch_size).set(report.sequences)
        self._m(self.batch_tokens).observe(report.tokens)
        self._m(self.batch_drafted).inc(report.drafted)
        self._m(self.batch_plain).inc(report.sequences - report.drafted)
        self._m(self.batch_rows).inc(report.rows)
        self._m(self.batch_prefill_rows).inc(report.prefill_rows)
        self._m(self.prefix_cache_rows).inc(report.prefix_rows)

    def started(self, queue_time: float, prompt_tokens: int) -> None:
        self._m(self.queue_time).observe(queue_time)
        self._m(self.prompt_tokens).inc(prompt_tokens)

    def first_token(self, since_arrival: float) -> None:
        self._m(self.ttft).observe(since_arrival)

    def completed(self, stats: GenerationStats, since_arrival: float, first_token_at: float | None) -> None:
        self._m(self.request_success, finished_reason=stats.finish_reason).inc()
        self._m(self.e2e_latency).observe(since_arrival)
        if stats.total_time > 0:
            self._m(self.tokens_per_s).set(stats.tokens_per_s)
            self._m(self.request_speed).observe(stats.tokens_per_s)
        if first_token_at is not None and stats.new_tokens > 1:
            self._m(self.tpot).observe((since_arrival - first_token_at) / (stats.new_tokens - 1))

    def cancelled(self) -> None:
        self._m(self.request_cancelled).inc()

    # ---- exposition --------------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
