"""`dpserve bench serve`'s report: the per-level text, the summary table, the plot and its title, the machine."""

from __future__ import annotations

from dpserve.bench.metrics import LATENCY_METRICS, PERCENTILES


def plot_title(report: dict) -> str:
    """What was measured, in one line: the label (or model and URL), endpoint, lengths, DP size when known."""
    cfg = report["config"]
    parts = [report.get("label") or f"{report['model']} @ {report['base_url']}", f"/v1/{report['endpoint']}",
             f"{cfg['input_len']} in / {cfg['output_len']} out tokens"]  # fmt: skip
    if cfg.get("identical_prompts"):
        parts.append("identical prompts")
    elif cfg.get("shared_prefix_len"):
        parts.append(f"{cfg['shared_prefix_len']}-token shared prefix")
    dp = (report.get("server") or {}).get("data_parallel_size")
    if dp:
        parts.append(f"DP={dp}")
    return " | ".join(parts)


def format_level(level: dict) -> str:
    lines = []
    title = (
        f" concurrency {level['concurrency']} "
        if level.get("request_rate") is None
        else f" rate {level['request_rate']} req/s (max concurrency {level.get('concurrency') or '-'}) "
    )
    lines.append(f"{title:=^60}")

    def row(name: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{name:<44}{value:>16}")

    row("Duration (s):", level["duration_s"])
    row("Completed requests:", level["completed"])
    row("Failed requests:", level["failed"])
    row("Total input tokens:", level["total_input_tokens"])
    row("Total generated tokens:", level["total_output_tokens"])
    row("Request throughput (req/s):", level["request_throughput"])
    row("Output token throughput (tok/s):", level["output_throughput"])
    row("Total token throughput (tok/s):", level["total_token_throughput"])
    labels = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in LATENCY_METRICS:
        lines.append(f"{labels[name]:-^60}")
        row(f"Mean {name.upper()} (ms):", level[f"mean_{name}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {name.upper()} (ms):", level[f"p{p}_{name}_ms"])
    for err in level["errors"]:
        lines.append(f"error x{err['count']}: {err['error']}")
    if level.get("usage_missing"):
        lines.append(f"note: {level['usage_missing']} responses had no usage chunk; output tokens counted otherwise")
    lines.append("=" * 60)
    return "\n".join(lines)


def format_summary(levels: list[dict]) -> str:
    head = (
        f"{'conc':>5} {'rate':>7} {'done':>5} {'fail':>4} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'E2EL p50':>9}"
    )
    lines = [head]
    for lv in levels:
        rate = "-" if lv.get("request_rate") is None else str(lv["request_rate"])
        lines.append(
            f"{lv.get('concurrency') or '-':>5} {rate:>7} {lv['completed']:>5} {lv['failed']:>4} "
            f"{lv['request_throughput']:>8.2f} {lv['output_throughput']:>10.1f} {lv['p50_ttft_ms']:>9.1f} "
            f"{lv['p99_ttft_ms']:>9.1f} {lv['p50_tpot_ms']:>9.2f} {lv['p50_itl_ms']:>8.2f} {lv['p50_e2el_ms']:>9.1f}"
        )
    return "\n".join(lines)


def write_png(path: str, levels: list[dict], title: str = "") -> None:
    """Latency percentiles and throughput versus the load level (or, for one level, the percentiles as bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate_mode = levels[0].get("request_rate") is not None
    xs = [lv["request_rate"] if rate_mode else lv["concurrency"] for lv in levels]
    categorical = any(isinstance(x, str) for x in xs)  # an "inf" rate: plot the levels evenly spaced
    labels = [str(x) for x in xs]
    if categorical:
        xs = list(range(len(xs)))
    xlabel = "request rate (req/s)" if rate_mode else "concurrency"
    if len(levels) > 1:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        ax_ttft, ax_tok, ax_thr = axes
        for p, style in zip(PERCENTILES, ("-", "--", ":")):
            ax_ttft.plot(xs, [lv[f"p{p}_ttft_ms"] for lv in levels], "o" + style, color="C0", label=f"TTFT p{p}")
            ax_ttft.plot(xs, [lv[f"p{p}_e2el_ms"] for lv in levels], "s" + style, color="C3", label=f"E2EL p{p}")
            ax_tok.plot(xs, [lv[f"p{p}_tpot_ms"] for lv in levels], "o" + style, color="C1", label=f"TPOT p{p}")
            ax_tok.plot(xs, [lv[f"p{p}_itl_ms"] for lv in levels], "s" + style, color="C2", label=f"ITL p{p}")
        ax_ttft.set_ylabel("ms")
        ax_ttft.set_title("TTFT and end-to-end latency")
        ax_tok.set_ylabel("ms")
        ax_tok.set_title("TPOT and inter-token latency")
        ax_thr.plot(xs, [lv["output_throughput"] for lv in levels], "o-", color="C0", label="output tok/s")
        ax_thr.plot(xs, [lv["total_token_throughput"] for lv in levels], "s--", color="C4", label="total tok/s")
        ax_thr.set_ylabel("tokens/s")
        ax_req = ax_thr.twinx()
        ax_req.plot(xs, [lv["request_throughput"] for lv in levels], "^:", color="C3", label="req/s")
        ax_req.set_ylabel("requests/s")
        ax_thr.set_title("throughput")
        handles = ax_thr.get_legend_handles_labels()
        handles2 = ax_req.get_legend_handles_labels()
        for ax in axes:
            ax.set_xlabel(xlabel)
            if not categorical and not rate_mode and min(xs) > 0:  # concurrency levels: 1, 2, 4, ... evenly apart
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, labels)  # ticks at the levels measured, nowhere else
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        # legends under their plots, not over the data
        below = dict(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
        ax_ttft.legend(**below)
        ax_tok.legend(**below)
        ax_thr.legend(handles[0] + handles2[0], handles[1] + handles2[1], **{**below, "ncol": 3})
    else:
        lv = levels[0]
        fig, axes = plt.subplots(1, len(LATENCY_METRICS), figsize=(16, 4))
        for ax, name in zip(axes, LATENCY_METRICS):
            keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
            ax.bar(keys, [lv[f"{k}_{name}_ms"] for k in keys], color="C0")
            ax.set_title(f"{name.upper()} (ms)")
            ax.grid(True, axis="y", alpha=0.3)
        x_label = f"{xlabel} {labels[0]}: {lv['output_throughput']:.1f} out tok/s, {lv['request_throughput']:.2f} req/s"
        fig.text(0.5, 0.01, x_label, ha="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def machine() -> dict:
    """The CPU this client ran on (for a local server, the server's too), its relevant flags and the kernel path
    an engine picks on it by default (dpserve_engine.cpu_paths)."""
    from dpserve_engine import cpu_paths

    cpu = cpu_paths.detect()
    return {**cpu.describe(), "default_kernel_path": cpu_paths.choose(cpu).describe()}
