"""Charts from ``scripts/bench/bench_spec.py`` results: speed-up against batch size.

One PNG per model: for each workload and configuration, the decode
throughput of speculation divided by plain decoding's, against B (log
scale), with the break-even line at 1. Several JSON files (a CPU run and a
GPU run, say) can be given; each file's device goes into the legend.

    .venv/bin/python scripts/bench/plot_bench.py bench_out/bench_spec.json --out docs/charts

Prints the paths it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def series(results: list[dict], device: str) -> dict:
    """model -> {label: [(B, ratio), ...]} from one file's ``results``."""
    out: dict = {}
    for result in results:
        for row in result["rows"]:
            if row["config"] == "none":
                continue
            label = f"{result['workload']}, {row['config']} ({device})"
            out.setdefault(result["model"], {}).setdefault(label, []).append(
                (row["B"], row["decode_ratio"]))
    return out


def figures(per_model: dict) -> dict:
    """model -> a matplotlib figure of its lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    for model, lines in sorted(per_model.items()):
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
        for label, points in sorted(lines.items()):
            points = sorted(points)
            ax.plot([b for b, _ in points], [r for _, r in points], marker="o", label=label)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        batch_sizes = sorted({b for points in lines.values() for b, _ in points})
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size B (concurrent requests)")
        ax.set_ylabel("decode tokens/s, speculation / plain")
        ax.set_title(f"{model}: speed-up of speculative decoding")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out[model] = fig
    return out


def plot(per_model: dict, out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for model, fig in figures(per_model).items():
        path = out_dir / f"speedup_{model}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench_spec.py JSON results")
    ap.add_argument("--out", default="bench_out/charts", help="folder for the PNGs")
    args = ap.parse_args(argv)
    per_model: dict = {}
    for f in args.files:
        data = json.loads(Path(f).read_text())
        device = data.get("device", "?")
        device = "GPU" if "gpu" in device.lower() else "CPU" if "cpu" in device.lower() else device
        for model, lines in series(data["results"], device).items():
            per_model.setdefault(model, {}).update(lines)
    for path in plot(per_model, Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
