"""`eaglespec bench`: Spec-Bench-style timing of our decoding methods and their peers.

datasets (prompt sets) -> methods (one interface for every way to generate) -> runner (timed runs, JSONL rows)
-> metrics (aggregation) -> report (Markdown table, PNG plots). machine records what it all ran on.
"""

from .datasets import Question, load_questions, select
from .methods import ALL_METHODS, BenchMethod, RunOutput, Sampling, build_methods
from .report import write_report
from .runner import BenchConfig, run_benchmark

__all__ = ["ALL_METHODS", "BenchConfig", "BenchMethod", "Question", "RunOutput", "Sampling", "build_methods",
           "load_questions", "run_benchmark", "select", "write_report"]
