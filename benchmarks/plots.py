"""The PNG of each figure, drawn from its JSON object (matplotlib, optional: skipped with a message)."""
from __future__ import annotations

import sys
from pathlib import Path

from .cases import FIGURE_FILES, OPS
from .impls import IMPLS

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22", "#17becf")


def write_plots(payload_by_fig: dict, out_dir: Path) -> list[Path]:
    """Write ``<figure>.png`` for every ``{figure: JSON object}`` into ``out_dir``; none without matplotlib. A figure
    without records (every cuflash case failed: its JSON lists the failures) is skipped with a message: there is
    nothing to draw, and its plotter asked matplotlib for a grid of 0 x 0 panels (a ValueError)."""
    empty = [fig for fig, payload in payload_by_fig.items() if not payload["records"]]
    if empty:
        print(f"plots skipped for {', '.join(empty)}: no records (see 'failed' and 'skipped' in the JSON)",
              file=sys.stderr)
        payload_by_fig = {fig: payload for fig, payload in payload_by_fig.items() if fig not in empty}
    if not payload_by_fig:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'cuflash[plot]')", file=sys.stderr)
        return []
    written = []
    for fig, payload in payload_by_fig.items():
        figure = PLOTTERS[fig](plt, payload)
        path = out_dir / f"{FIGURE_FILES[fig]}.png"
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _caption(payload: dict) -> str:
    dev = payload["device"]
    return f"{dev['name']} · {payload['date'][:10]} · commit {payload['commit'][:10]}"


def _color(impl: str) -> str:
    """One color per impl across every panel and figure."""
    names = list(IMPLS)
    return _PALETTE[names.index(impl) % len(_PALETTE)] if impl in names else "#000000"


def _lines(ax, records, *, x, y, label=lambda r: r["impl"], logx=True):
    """One line per label; the color follows the record's impl, the style its other attributes."""
    series: dict = {}
    for r in records:
        if r.get(y) is not None:
            series.setdefault(label(r), (r["impl"], []))[1].append((r[x], r[y]))
    styles: dict = {}
    for name, (impl, pts) in series.items():
        pts.sort()
        style = styles.setdefault(impl, ["-", "--", ":", "-."])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, color=_color(impl),
                ls=style.pop(0) if len(style) > 1 else style[0], label=name)
    if logx:
        from matplotlib.ticker import FuncFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1024:g}k" if v >= 1024 else f"{v:g}"))
    ax.grid(alpha=0.3)


def _labels(ax, xlabel, ylabel, *, legend=7):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend)


def _finish(fig, payload, fontsize=10):
    fig.suptitle(f"{payload['title']}\n{_caption(payload)}", fontsize=fontsize)
    fig.tight_layout()
    return fig


def _plot_throughput(plt, payload):
    recs = payload["records"]
    combos = sorted({(r["head_dim"], r["causal"]) for r in recs})
    ops = [op for op in OPS if any(r["op"] == op for r in recs)]
    fig, axes = plt.subplots(len(ops), len(combos), figsize=(4.2 * len(combos), 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, (d, causal) in enumerate(combos):
            ax = axes[i][j]
            _lines(ax, [r for r in recs if r["op"] == op and r["head_dim"] == d and r["causal"] == causal],
                   x="seqlen_q", y="tflops")
            ax.set_title(f"{op}, head_dim {d}, {'causal' if causal else 'non-causal'}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
    for ax in axes.flat:
        ax.legend(fontsize=6)
    return _finish(fig, payload, 10)


def _plot_memory(plt, payload):
    recs = payload["records"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    cuf = {r["seqlen_q"]: r["ms"] for r in recs if r["impl"] == "cuflash"}
    speed = [dict(r, speedup=r["ms"] / cuf[r["seqlen_q"]]) for r in recs
             if r["impl"] != "cuflash" and r["seqlen_q"] in cuf]
    _lines(ax1, speed, x="seqlen_q", y="speedup", label=lambda r: f"cuflash vs {r['impl']}")
    ax1.axhline(1.0, color="gray", lw=0.8)
    _labels(ax1, "seqlen", "speedup of cuflash (x)")
    _lines(ax2, [dict(r, peak_mb=r["peak_bytes"] / 2**20) for r in recs if r["peak_bytes"] is not None],
           x="seqlen_q", y="peak_mb")
    for e in payload.get("skipped", []):
        if "memory" in e["reason"].lower():
            ax2.annotate(f"{e['impl']}: OOM", (e["seqlen_q"], 1), fontsize=7, rotation=90)
    ax2.set_yscale("log")
    _labels(ax2, "seqlen", "peak extra memory (MiB)")
    return _finish(fig, payload, 10)


def _plot_blocksparse(plt, payload):
    recs = payload["records"]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    for op in OPS:
        rows = sorted((r["density"], r["ms"]) for r in recs if r["op"] == op)
        if not rows:
            continue
        ax.plot(*zip(*rows), marker="o", label=f"cuflash {op}")
        dense = rows[-1]
        ax.plot([0, dense[0]], [0, dense[1]], ls="--", color="gray", lw=0.8)
    ax.set_xlabel("BlockMask density")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="dashed: runtime proportional to density", title_fontsize=7)
    return _finish(fig, payload, 9)


def _plot_tiles(plt, payload):
    records = payload["records"]
    fig, ax = plt.subplots(figsize=(5, 3.8))
    if any(r.get("tile") for r in records):  # whole tiles (CUDA): one bar each, grouped by head_dim, TFLOP/s
        rows = [r for r in records if r.get("tile") and r.get("tflops") is not None]
        names = [f"{r['op']} d{r['head_dim']} {'x'.join(map(str, r['tile']))}" for r in rows]
        ax.barh(range(len(rows)), [r["tflops"] for r in rows], color=[_color("cuflash")] * len(rows))
        ax.set_yticks(range(len(rows)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOP/s (block_m x block_n x warps; the A100 table's row first per op and head_dim)")
        ax.grid(alpha=0.3, axis="x")
        return _finish(fig, payload, 9)
    _lines(ax, records, x="block_k", y="ms", label=lambda r: f"cuflash d={r['head_dim']}")
    _labels(ax, "key-block size (block_k)", "forward ms")
    return _finish(fig, payload, 9)


def _plot_decode(plt, payload):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    _lines(ax, payload["records"], x="seqlen_q", y="gbps", label=lambda r: f"{r['impl']} Sk={r['seqlen_k']}")
    bw = payload["device"].get("bandwidth_gbps")
    if bw:
        ax.axhline(bw, color="gray", ls="--", lw=0.8, label=f"device peak {bw:g} GB/s")
    _labels(ax, "seqlen_q", "GB/s (inputs read + output written; ~ K/V)", legend=6)
    return _finish(fig, payload, 9)


def _plot_product(plt, payload):
    recs = payload["records"]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.barh([r["impl"] for r in recs], [r["ms"] for r in recs])
    ax.set_xlabel("ms (lower is better)")
    return _finish(fig, payload, 8)


def _plot_wide(plt, payload):
    recs = payload["records"]
    dtypes = sorted({r["dtype"] for r in recs})
    ops = [op for op in OPS if any(r["op"] == op for r in recs)]
    fig, axes = plt.subplots(len(ops), len(dtypes), figsize=(4.0 * len(dtypes), 3.2 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, dt in enumerate(dtypes):
            ax = axes[i][j]
            _lines(ax, [r for r in recs if r["op"] == op and r["dtype"] == dt], x="seqlen_q", y="tflops")
            ax.set_title(f"{op}, {dt}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.legend(fontsize=6)
    return _finish(fig, payload, 10)


PLOTTERS = {"product": _plot_product, "throughput": _plot_throughput, "memory": _plot_memory,
            "blocksparse": _plot_blocksparse, "tiles": _plot_tiles, "decode": _plot_decode, "wide": _plot_wide}
