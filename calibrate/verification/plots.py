"""The PNG plots of verify's report (matplotlib on the Agg backend: no display needed); report.md links them."""

from pathlib import Path

from ..choices import scheme_label
from .verdict_table import measured_schemes


def plot_layer_error(path: Path, rep: dict) -> None:
    """Per-layer attention-output relative error, one line per scheme (log scale)."""
    plt = _pyplot()
    layers = [layer["layer_idx"] for layer in rep["layers"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in rep["schemes"].items():
        if r["mode"] != "reference":
            ax.plot(layers, r["layer_rel_error"], marker="o", ms=3, label=scheme_label(name))
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="layer", ylabel="relative RMS error of attention output", title="Per-layer attention error (each layer's own inputs)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a verify of the reference alone has no lines to name
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl_by_depth(path: Path, rep: dict) -> None:
    """KL against context depth, one line per scheme (log x at each bucket's middle); packed positions dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in measured_schemes(rep).items():
        d = r.get("depth")
        if d is None:
            continue
        real = [b for b in d["buckets"] if b["kl"] is not None]
        line = ax.plot([(b["start"] + b["end"]) / 2 for b in real], [b["kl"] for b in real], marker="o", ms=4, label=scheme_label(name))[0]
        if d["packed"]:
            ax.plot([(b["start"] + b["end"]) / 2 for b in d["packed"]], [b["kl"] for b in d["packed"]], ls="--", marker="x", ms=4,
                    color=line.get_color(), label=f"{scheme_label(name)} (packed positions)")
    ax.set_xscale("log")
    ax.set(xlabel="depth in the record (positions; bucket middles)", ylabel="KL(reference ‖ scheme), nats/token",
           title="KL by context depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale_heatmap(path: Path, layers: list[int], scales: dict[str, list], title: str) -> None:
    """K and V scales as layer × head heatmaps (log color)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, max(3, 0.18 * len(layers) + 1.5)))
    for ax, kind in zip(axes, ("k", "v")):
        values = np.asarray(scales[kind], dtype=float)  # [L, H]
        im = ax.imshow(values, aspect="auto", norm=LogNorm(), cmap="viridis", interpolation="nearest")
        ax.set(title=f"{kind}_scale", xlabel="KV head", ylabel="layer")
        ax.set_yticks(range(len(layers))[:: max(1, len(layers) // 15)], [str(x) for x in layers[:: max(1, len(layers) // 15)]])
        ax.set_xticks(range(values.shape[1]))
        fig.colorbar(im, ax=ax)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_position_profile(path: Path, layers: list[int], profile: dict) -> None:
    """Absmax (max over heads) by position bucket, per layer, for K, V and Q; empty buckets blank."""
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    tokens = np.asarray(profile["tokens"])  # [L, P]
    used = np.flatnonzero(tokens.sum(0) > 0)
    starts = [profile["bucket_starts"][i] for i in used]
    fig, axes = plt.subplots(1, 3, figsize=(13, max(3, 0.18 * len(layers) + 1.5)))
    for ax, kind in zip(axes, ("k", "v", "q")):
        values = np.asarray(profile[kind], dtype=float)[:, used]  # [L, P_used]
        values = np.where(tokens[:, used] > 0, values, np.nan)
        im = ax.imshow(values, aspect="auto", norm=LogNorm(), cmap="magma", interpolation="nearest")
        ax.set(title=f"{kind} absmax", xlabel="position bucket (first position)", ylabel="layer")
        ax.set_xticks(range(len(starts)), [str(s) for s in starts], rotation=60, fontsize=7)
        ax.set_yticks(range(len(layers))[:: max(1, len(layers) // 15)], [str(x) for x in layers[:: max(1, len(layers) // 15)]])
        fig.colorbar(im, ax=ax)
    fig.suptitle("Absmax by token position (max over heads), from the calibration statistics")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
