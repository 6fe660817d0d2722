"""Benchmark report: a Markdown summary and PNG plots, built only from `results.jsonl` (and `run.json`).

`write_report(DIR)` is what both `eaglespec bench` (at the end of a run) and `eaglespec bench report DIR` call,
so a report rebuilt later is the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import EagleSpecError
from .metrics import Summary, engine_agreement, group, read_rows, summarise, vanilla_index
from .runner import RESULTS, RUN_INFO

SUMMARY = "summary.md"
PLOT_SPEEDUP = "speedup_by_category.png"
PLOT_TAU = "tau_distribution.png"
PLOT_SWEEP = "sweep_tokens_per_s.png"


def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _section(title: str, text: str, header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"## {title}", "", text, ""] + _table(header, rows) + [""]


def _count(equal: int | None, compared: int) -> str:
    if equal is None:
        return "-"
    return f"{equal}/{compared}" + ("" if equal == compared else " **differs**")


def _equal(s: Summary) -> str:
    return _count(s.equal, s.compared)


def overall(rows: list[dict]) -> list[Summary]:
    base = vanilla_index(rows)
    return [summarise(rs, v, base) for v, rs in group(rows, lambda r: r["variant"]).items()]


def per_category(rows: list[dict]) -> dict[str, dict[str, Summary]]:
    """category -> variant -> Summary."""
    base = vanilla_index(rows)
    out: dict[str, dict[str, Summary]] = {}
    for (cat, variant), rs in group(rows, lambda r: (r["category"], r["variant"])).items():
        out.setdefault(cat, {})[variant] = summarise(rs, variant, base)
    return out


def _header(info: dict | None) -> list[str]:
    if not info:
        return ["(no run.json next to the results: run settings unknown)", ""]
    m = info.get("machine", {})
    v = {k: x for k, x in m.get("versions", {}).items() if x}
    s = info.get("sampling", {})
    sampling = "greedy" if info.get("greedy") else (
        f"temperature {s.get('temperature')}, top-p {s.get('top_p')}, top-k {s.get('top_k')}, seed {s.get('seed')}")
    lines = [
        f"- command: `{info.get('command', '?')}`",
        f"- started: {info.get('started', '?')}",
        f"- dataset: {info.get('dataset')} ({info.get('questions')} questions, {info.get('prompts')} prompts), "
        f"max new tokens {info.get('max_new_tokens')}, {sampling}",
        f"- timing: {info.get('repeats')} timed repeats per prompt (row = median-speed repeat), "
        f"{info.get('warmup_runs')} untimed warm-up run(s) per method; {info.get('token_counting')}",
        f"- machine: {m.get('cpu')}, {m.get('cpu_count')} CPUs, torch threads {m.get('torch_threads')}, "
        f"{m.get('memory_gb')} GB RAM, GPU: {', '.join(m['gpu']) if m.get('gpu') else 'none'}, {m.get('os')}",
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items())
        + (f", eaglespec git {m['git_commit']}" if m.get("git_commit") else ""),
        f"- settings: {json.dumps(info.get('settings', {}), sort_keys=True)}",
        f"- peak memory: {info.get('memory')}",
    ]
    if info.get("reference"):
        lines.append(f"- vanilla was not run again: its answers and timings come from `{info['reference']}` "
                     "(equality checks hold; speedups compare runs made at different times)")
    for method in info.get("methods", []):
        if method.get("settings"):
            lines.append(f"- {method['name']}: {json.dumps(method['settings'], sort_keys=True)}")
    return lines + [""]


def markdown(rows: list[dict], info: dict | None) -> str:
    summaries = overall(rows)
    lines = [f"# eaglespec bench: {info.get('dataset') if info else 'results'}", ""]
    lines += _header(info)
    lines += ["## Overall", ""]
    lines += _table(
        ["method", "prompts", "new tokens", "tokens/s", "range (slowest-fastest repeat)", "speedup", "tau",
         "equal to vanilla", "draft time", "verify time", "peak RSS MiB"],
        [[s.variant, str(s.prompts), str(s.new_tokens), _f(s.tokens_per_s), f"{_f(s.tokens_per_s_low)}-"
          f"{_f(s.tokens_per_s_high)}", _f(s.speedup, suffix="x"), _f(s.tau), _equal(s), _pct(s.draft_share),
          _pct(s.verify_share), _f(s.peak_rss_mb, 0)] for s in summaries])
    lines += ["", "tokens/s = all new tokens / all wall time; speedup = that over vanilla's on the same prompts; "
              "tau = tokens per target forward (bonus token included); draft / verify time = share of wall time "
              "(verify includes the prefill).", ""]
    agreement = engine_agreement(rows)
    if agreement:
        lines += _section(
            "Speculative peers against their own plain decoding",
            "Greedy answers of each speculative peer against the same engine's plain ones on the same prompts "
            "(lossless speculation inside that engine keeps them equal; against ours they may differ, as the peers "
            "run other arithmetic).",
            ["method", "its plain decoding", "equal", "first differing token"],
            [[a.variant, a.plain, _count(a.equal, a.compared), "-" if a.first_mismatch is None
              else str(a.first_mismatch)] for a in agreement])
    if any(s.method == "oracle" for s in summaries):
        lines += ["oracle = a measurement, not a method: it drafts plain decoding's own answer (a chain of --depth "
                  "tokens), so every draft token is accepted and drafting costs nothing; its speedup is the most "
                  "any drafter can reach with that many draft tokens per verify pass on this machine.", ""]
    cats = per_category(rows)
    variants = [s.variant for s in summaries]
    lines += ["## Per category: tokens/s, speedup, tau", ""]
    table = []
    for cat, by_variant in cats.items():
        cells = []
        for v in variants:
            s = by_variant.get(v)
            cells.append("-" if s is None else
                         f"{_f(s.tokens_per_s, 1)} / {_f(s.speedup, suffix='x')} / {_f(s.tau)}")
        table.append([cat] + cells)
    lines += _table(["category"] + variants, table)
    lines += [""]
    accepting = [s for s in summaries if s.acceptance_per_depth]
    if accepting:
        depth = max(len(s.acceptance_per_depth) for s in accepting)
        lines += ["## Acceptance rate per tree depth", "",
                  "Share of verify steps whose draft reached depth d that accepted a token at depth d.", ""]
        lines += _table(["method"] + [f"d{d + 1}" for d in range(depth)],
                        [[s.variant] + [_pct(a) for a in s.acceptance_per_depth]
                         + ["-"] * (depth - len(s.acceptance_per_depth)) for s in accepting])
        lines += [""]
    work = [s for s in summaries if s.traffic is not None or s.draft_forwards_per_pass]
    if work:
        lines += _section(
            "Draft work and memory traffic",
            "Draft forwards (of the draft model or head) and stage-2 guesses the draft model accepted, per target "
            "forward; weights read per generated token as a share of plain decoding's (its one target forward a "
            "token), as staged speculative decoding's paper reports it.",
            ["method", "draft forwards / target forward", "stage-2 acceptance", "weights read / token"],
            [[s.variant, _f(s.draft_forwards_per_pass), _pct(s.stage2_acceptance), _f(s.traffic, suffix="x")]
             for s in work])
    swept = [s for s in summaries if s.sweep]
    if swept:
        key = next(iter(swept[0].sweep))
        lines += [f"## Sweep over {key}", ""]
        lines += _table(["method", key, "tokens/s", "speedup", "tau"],
                        [[s.method, str(s.sweep[key]), _f(s.tokens_per_s), _f(s.speedup, suffix="x"), _f(s.tau)]
                         for s in swept])
        lines += [""]
    return "\n".join(lines)


def _plots(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    written = []
    summaries = overall(rows)
    cats = per_category(rows)
    variants = [s.variant for s in summaries if s.variant != "vanilla"]
    if variants:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) + 2), 4.5))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            values = [cats[c][v].speedup if v in cats[c] and cats[c][v].speedup is not None else 0.0 for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], values, width, label=v)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(cats))], list(cats), rotation=30,
                      ha="right")
        ax.set_ylabel("speedup over vanilla (tokens/s ratio)")
        ax.set_title("Speedup per category")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / PLOT_SPEEDUP)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    with_tau = [(v, [r["tau"] for r in rs if r.get("tau") is not None])
                for v, rs in group(rows, lambda r: r["variant"]).items()]
    with_tau = [(v, t) for v, t in with_tau if t]
    if with_tau:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(with_tau) + 2), 4.5))
        ax.boxplot([t for _, t in with_tau])
        ax.set_xticks(range(1, len(with_tau) + 1), [v for v, _ in with_tau], rotation=30, ha="right")
        ax.set_ylabel("tau per prompt (tokens per target forward)")
        ax.set_title("tau distribution")
        fig.tight_layout()
        written.append(out_dir / PLOT_TAU)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    swept = [s for s in summaries if s.sweep]
    if swept:
        key = next(iter(swept[0].sweep))
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for method, items in group(swept, lambda s: s.method).items():
            items = sorted(items, key=lambda s: s.sweep[key])
            ax.plot([s.sweep[key] for s in items], [s.tokens_per_s for s in items], marker="o", label=method)
        base = next((s for s in summaries if s.variant == "vanilla"), None)
        if base:
            ax.axhline(base.tokens_per_s, color="black", linewidth=0.8, linestyle="--", label="vanilla")
        ax.set_xlabel(key)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"tokens/s vs {key}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / PLOT_SWEEP)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def load_run(out_dir: str | Path) -> tuple[list[dict], dict | None]:
    out_dir = Path(out_dir)
    results = out_dir / RESULTS
    if not results.is_file():
        raise EagleSpecError(f"'{out_dir}' has no {RESULTS}: point at the --out folder of a bench run")
    info = None
    if (out_dir / RUN_INFO).is_file():
        try:
            info = json.loads((out_dir / RUN_INFO).read_text())
        except json.JSONDecodeError as exc:
            raise EagleSpecError(f"{out_dir / RUN_INFO}: not valid JSON ({exc.msg})") from None
    return read_rows(results), info


def write_report(out_dir: str | Path, plots: bool = True) -> list[Path]:
    """(Re)build summary.md and the plots of a bench folder from its results.jsonl; returns the files written."""
    out_dir = Path(out_dir)
    rows, info = load_run(out_dir)
    summary = out_dir / SUMMARY
    summary.write_text(markdown(rows, info))
    return [summary] + (_plots(rows, out_dir) if plots else [])
