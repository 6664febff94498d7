"""Plots people would rather look at than read (matplotlib, PNG)."""
from __future__ import annotations

import torch


def skip_heatmap(rec: dict, tokens: list[str], path, max_tokens: int = 96) -> None:
    """Per-layer skip rate for each token over a text: two panels (attention head groups, FFN groups),
    rows = layers, columns = tokens, colour = fraction of groups skipped. `rec` is from record_masks over
    one sequence (batch 1); forward calls are concatenated in order (prefill, then decode steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def grid(kind):  # [L, N] skip fraction
        return torch.stack([1 - torch.cat([m.float().mean(-1).reshape(-1) for m in calls]).cpu()
                            for calls in rec[kind]])

    a, f = grid("attn"), grid("ffn")
    n = min(a.shape[1], len(tokens), max_tokens)
    a, f, tokens = a[:, :n], f[:, :n], tokens[:n]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.22 * n), 1.2 + 0.25 * a.shape[0] * 2), constrained_layout=True)
    for ax, g, name in zip(axes, (a, f), ("attention head groups", "FFN channel groups")):
        im = ax.imshow(g.numpy(), aspect="auto", cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
        ax.set_ylabel("layer")
        ax.set_title(f"skipped fraction of {name} (mean {g.mean():.2f})")
        ax.set_xticks(range(n))
        ax.set_xticklabels([t.replace("\n", "\\n") for t in tokens], rotation=90, fontsize=6)
    fig.colorbar(im, ax=axes, shrink=0.6, label="skipped fraction")
    fig.savefig(path, dpi=120)
    plt.close(fig)
