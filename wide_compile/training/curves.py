"""Training curves: what a phase writes as data (curve.json) and as a picture (curve.png).

A curve has `train` records (one per logging interval: step, tokens seen, loss terms, capacities, tau) and
`eval` records (one per held-out evaluation: step, tokens, held-out ppl of the routed model, its capacity,
the dense ppl on the same tokens, whether it was the best so far).
"""
from __future__ import annotations

import json
from pathlib import Path


def write_curve(out_dir, name: str, curve: dict) -> tuple[Path, Path | None]:
    """Write <out_dir>/curve.json and curve.png (the PNG only where matplotlib is installed: it is plotting,
    never a reason to lose a run). Returns (json path, png path or None)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "curve.json"
    tmp = js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(curve, indent=1))
    tmp.replace(js)
    try:
        png = plot_curve(curve, out / "curve.png", title=name)
    except ImportError:
        png = None
    return js, png


def plot_curve(curve: dict, path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = curve.get("train", []), curve.get("eval", [])
    fig, (ax_l, ax_c, ax_p) = plt.subplots(1, 3, figsize=(15, 4))
    tok = [r["tokens"] / 1e6 for r in train]
    for key in ("loss", "kd", "lm"):
        if train and key in train[0]:
            ax_l.plot(tok, [r[key] for r in train], label=key)
    ax_l.set(xlabel="tokens seen (M)", ylabel="loss", title="training loss")
    if train:
        ax_l.legend()
    for key in ("cap", "attn", "ffn"):
        if train and key in train[0]:
            ax_c.plot(tok, [r[key] for r in train], label={"cap": "overall"}.get(key, key))
    if train and "target" in train[0]:
        ax_c.plot(tok, [r["target"] for r in train], "k--", lw=0.8, label="target (overall)")
    ax_c.set(xlabel="tokens seen (M)", ylabel="capacity (relaxed, FLOP-weighted)", title="capacity and tau")
    if train:
        ax_c.legend(loc="upper right")
    if train and "tau" in train[0]:
        ax_t = ax_c.twinx()
        ax_t.plot(tok, [r["tau"] for r in train], color="grey", lw=0.8)
        ax_t.set_ylabel("tau", color="grey")
    if evals:
        et = [r["tokens"] / 1e6 for r in evals]
        ax_p.plot(et, [r["ppl"] for r in evals], "o-", label="routed (held-out)")
        if evals[0].get("dense_ppl"):
            ax_p.axhline(evals[0]["dense_ppl"], color="k", ls="--", lw=0.8, label="dense")
        best = [r for r in evals if r.get("best")]
        if best:
            ax_p.plot([best[-1]["tokens"] / 1e6], [best[-1]["ppl"]], "r*", ms=12, label="best")
        ax_p.set_yscale("log")
        ax_p.legend()
    ax_p.set(xlabel="tokens seen (M)", ylabel="perplexity", title="held-out perplexity")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)
