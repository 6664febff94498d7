"""Held-out ppl against tokens seen: the shipped runs (c0.5-chat, c0.7-chat) and the s1n-r64 runs, both stages."""
import json
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
for ax, cap in zip(axes, ("0.5", "0.7")):
    for run, style, label in ((f"c{cap}-chat", "--", "shipped (noise off at 80 %, tau 5 -> 0.5, LoRA r16)"),
                              (f"s1n-r64/c{cap}", "-", "s1n-r64 (noise on, tau 5 -> 1.5, LoRA r64)")):
        off = 0
        for st, color in (("stage1", "tab:blue"), ("stage2", "tab:red")):
            ev = json.load(open(f"{run}/{st}/curve.json"))["eval"]
            xs = [off + e["tokens"] / 1e6 for e in ev]
            ax.plot(xs, [e["ppl"] for e in ev], style, color=color, label=f"{st}: {label}")
            off = xs[-1]
    ax.axhline(ev[0]["dense_ppl"], color="gray", lw=0.8)
    ax.set_title(f"capacity {cap}")
    ax.set_xlabel("tokens seen, stage 1 then stage 2 (M)")
    ax.set_ylabel("held-out train-text ppl (dense: gray)")
    ax.set_ylim(25, 90)
axes[0].legend(fontsize=7)
fig.tight_layout()
fig.savefig("s1n-r64/heldout-vs-shipped.png", dpi=110)
