"""The demo's logit-lens figure: a [layer x position] heatmap of the lens's top token, and the
probability of the model's own answer layer by layer beside it (matplotlib, written as a PNG)."""

from __future__ import annotations

from pathlib import Path

import torch


def show(text: str, width: int = 12) -> str:
    """A token as it reads in a table: quoted (so leading spaces show), cut to ``width``."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 2] + "…" + shown[-1]



def heatmap(prompt: str, words: list[str], table: list[list[str]], probs: torch.Tensor, labels: list[str],
            p_target: torch.Tensor, target: str, path: Path) -> Path:
    """Left: a [layer x position] heatmap of the top token's probability, each cell labelled with
    the token (embedding row at the bottom). Right: the probability of the model's answer at the
    last position, layer by layer, on the same rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = len(labels), len(words)
    fig, (ax, side) = plt.subplots(1, 2, sharey=True, figsize=(1.9 * cols + 5.5, 0.36 * rows + 2.2),
                                   gridspec_kw={"width_ratios": [cols, 2.2], "wspace": 0.04})
    image = ax.imshow(probs.numpy(), origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for y, row in enumerate(table):
        for x, token in enumerate(row):
            light = float(probs[y, x]) < 0.55
            ax.text(x, y, show(token, 12), ha="center", va="center", fontsize=9, family="monospace",
                    color="white" if light else "black")
    ax.set_xticks(range(cols), [repr(w) for w in words], fontsize=10)
    ax.set_yticks(range(rows), labels, fontsize=9)
    ax.axhline(0.5, color="white", linewidth=1.5)  # the embedding row below, the layers above
    ax.set_xlabel("input position (each cell: the lens's top next-token guess there)", fontsize=10)
    ax.set_ylabel("layer (resid_post; 'embed' = resid_pre.0)", fontsize=10)
    ax.set_title(f"Logit lens on {prompt!r}", fontsize=12)

    side.plot(p_target.numpy(), range(rows), marker="o", markersize=4, color="tab:red")
    side.set_xlim(0, 1)
    side.grid(alpha=0.3)
    side.set_xlabel(f"p({target!r}) at the last position", fontsize=10)
    side.set_title("the model's answer, by layer", fontsize=11)
    side.tick_params(labelsize=9)
    bar = fig.colorbar(image, ax=[ax, side], fraction=0.025, pad=0.02)
    bar.set_label("probability of the top token", fontsize=10)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return path.resolve()
