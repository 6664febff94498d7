"""Zero-shot accuracy retention above chance: (acc_wide - chance) / (acc_dense - chance) per task.

A task where dense is within `margin` of chance is flagged uninformative: there the ratio divides noise
by noise. Accuracies come from lm-eval (tasks.evaluate_tasks) on the local data.
"""
from __future__ import annotations

from .tasks import CHANCE

MARGIN = 0.05  # dense accuracy must clear chance by this much for a task to count


def retention_above_chance(acc_wide: float, acc_dense: float, chance: float) -> float | None:
    """(acc_wide - chance) / (acc_dense - chance); None when dense is not above chance."""
    head = acc_dense - chance
    return (acc_wide - chance) / head if head > 0 else None


def compare_tasks(dense: dict, wide: dict, margin: float = MARGIN, metric: str = "acc") -> dict:
    """{"tasks": {task: {...}}, "mean_retention_informative"} from two evaluate_tasks results."""
    rows = {}
    for t, d in dense.items():
        ch = CHANCE[t]
        ad, aw = d[metric], wide[t][metric]
        rows[t] = {"chance": ch, "dense": ad, "wide": aw, "n": d.get("n"),
                   "retention_above_chance": retention_above_chance(aw, ad, ch),
                   "informative": ad - ch >= margin}
    good = [r["retention_above_chance"] for r in rows.values()
            if r["informative"] and r["retention_above_chance"] is not None]
    return {"metric": metric, "margin": margin, "tasks": rows,
            "mean_retention_informative": sum(good) / len(good) if good else None,
            "uninformative": [t for t, r in rows.items() if not r["informative"]]}
