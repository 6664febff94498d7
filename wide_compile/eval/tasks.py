"""Zero-shot tasks through lm-eval on the local data copies (../shared/data), never the HF hub.

`prepare_tasks(data_root, work_dir, limit)` converts the local files into one normalised JSONL per task
(PIQA labels joined, ARC choices unpacked, HellaSwag pre-processed exactly as lm-eval's `hellaswag` task,
BoolQ answer -> 0/1) and writes lm-eval YAML task configs (`dataset_path: json`, absolute `data_files`)
into `work_dir`. The prompts/choices follow lm-eval's own arc_easy / arc_challenge / piqa / hellaswag /
boolq tasks. All five report acc and acc_norm (for BoolQ, lm-eval's own task reports acc only).
With `limit`, each task keeps a seeded random subset of `limit` items (seed 1234), not the first ones.

`evaluate_tasks(model, tokenizer, tasks_dir, ...)` runs lm-eval's HFLM on the in-memory model.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import re
from pathlib import Path

TASKS = ("arc_easy", "arc_challenge", "piqa", "hellaswag", "boolq")
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "piqa": 0.5, "hellaswag": 0.25, "boolq": 0.5}
PREFIX = "wide_"  # local task names: wide_arc_easy, ... (no clash with lm-eval's hub tasks)

_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: multiple_choice
test_split: test
doc_to_text: {text}
doc_to_target: label
doc_to_choice: {choice}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  source: local copy under {root} (wide_compile.eval.tasks)
"""

_PROMPTS = {  # (doc_to_text, doc_to_choice) as in lm-eval's tasks
    "arc_easy": ('"Question: {{question}}\\nAnswer:"', '"{{choices}}"'),
    "arc_challenge": ('"Question: {{question}}\\nAnswer:"', '"{{choices}}"'),
    "piqa": ('"Question: {{goal}}\\nAnswer:"', '"{{[sol1, sol2]}}"'),
    "hellaswag": ('"{{query}}"', '"{{choices}}"'),
    "boolq": ('"{{passage}}\\nQuestion: {{question}}?\\nAnswer:"', "['no', 'yes']"),
}

_FILES = {
    "arc_easy": ["arc-easy/ARC-Easy-Test.jsonl"],
    "arc_challenge": ["arc-challenge/ARC-Challenge-Test.jsonl"],
    "piqa": ["piqa/valid.jsonl", "piqa/valid-labels.lst"],
    "hellaswag": ["hellaswag/hellaswag_val.reconstructed.jsonl.gz"],
    "boolq": ["boolq/dev.jsonl"],
}


def data_files(tasks=TASKS) -> list[str]:
    """The files under the data root that `tasks` read (relative paths), for checking before a model loads."""
    return [f for t in tasks for f in _FILES[t]]


def _read_jsonl(p: Path) -> list[dict]:
    op = gzip.open if p.name.endswith(".gz") else open
    with op(p, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _hs_pre(text: str) -> str:  # lm-eval tasks/hellaswag/utils.py preprocess
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def load_task_docs(task: str, root: Path) -> list[dict]:
    root = Path(root)
    if task in ("arc_easy", "arc_challenge"):
        out = []
        for d in _read_jsonl(root / _FILES[task][0]):
            labels = [c["label"] for c in d["question"]["choices"]]
            out.append({"id": d["id"], "question": d["question"]["stem"],
                        "choices": [c["text"] for c in d["question"]["choices"]],
                        "label": labels.index(d["answerKey"])})
        return out
    if task == "piqa":
        docs = _read_jsonl(root / _FILES[task][0])
        labels = [int(x) for x in (root / _FILES[task][1]).read_text().split()]
        if len(docs) != len(labels):
            raise ValueError(f"PIQA: {len(docs)} items but {len(labels)} labels")
        return [{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": y} for d, y in zip(docs, labels)]
    if task == "hellaswag":
        out = []
        for d in _read_jsonl(root / _FILES[task][0]):
            ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize()
            out.append({"query": _hs_pre(d["activity_label"] + ": " + ctx),
                        "choices": [_hs_pre(e) for e in d["endings"]], "label": int(d["label"])})
        return out
    if task == "boolq":
        return [{"passage": d["passage"], "question": d["question"], "label": int(bool(d["answer"]))}
                for d in _read_jsonl(root / _FILES[task][0])]
    raise ValueError(f"unknown task {task!r}; choose from {TASKS}")


def prepare_tasks(data_root, work_dir, limit: int | None = None, tasks=TASKS, seed: int = 1234) -> dict:
    """Write normalised JSONL + lm-eval YAMLs into work_dir. Returns {task: n_items}."""
    data_root, work_dir = Path(data_root).resolve(), Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for t in tasks:
        docs = load_task_docs(t, data_root)
        if limit and limit < len(docs):
            idx = sorted(random.Random(seed).sample(range(len(docs)), limit))
            docs = [docs[i] for i in idx]
        p = work_dir / f"{t}.jsonl"
        with open(p, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        counts[t] = len(docs)
    (work_dir / "counts.json").write_text(json.dumps({"limit": limit, "seed": seed, "counts": counts,
                                                      "source": str(data_root)}))
    write_yamls(work_dir)
    return counts


def write_yamls(work_dir) -> list[str]:
    """(Re)write the lm-eval YAMLs of a prepared folder so they point at its JSONL files wherever the
    folder now is (a prepared folder can be copied to another machine)."""
    work_dir = Path(work_dir).resolve()
    meta = json.loads((work_dir / "counts.json").read_text())
    names = []
    for t in meta["counts"]:
        text, choice = _PROMPTS[t]
        (work_dir / f"{PREFIX}{t}.yaml").write_text(_YAML.format(
            name=PREFIX + t, path=json.dumps(str(work_dir / f"{t}.jsonl")), text=text, choice=choice,
            root=meta.get("source", "?")))
        names.append(PREFIX + t)
    return names


def task_manager(tasks_dir):
    from lm_eval.tasks import TaskManager

    try:
        return TaskManager(include_path=str(tasks_dir), include_defaults=False)
    except TypeError:  # older lm-eval
        return TaskManager(include_path=str(tasks_dir))


def build_task_dict(tasks_dir, tasks=TASKS):
    from lm_eval.tasks import get_task_dict

    return get_task_dict([PREFIX + t for t in tasks], task_manager(tasks_dir))


def make_lm(model, tokenizer, batch_size: int = 64, max_length: int = 2048):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)


def evaluate_tasks(model, tokenizer, tasks_dir, tasks=TASKS, batch_size: int = 64, task_dict=None) -> dict:
    """{task: {"acc", "acc_norm", "n"}} for `model` (routers attached or not) via lm-eval."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import evaluator

    lm = make_lm(model, tokenizer, batch_size)
    td = task_dict if task_dict is not None else build_task_dict(tasks_dir, tasks)
    res = evaluator.evaluate(lm=lm, task_dict=td, bootstrap_iters=0, log_samples=False, verbosity="WARNING")
    out = {}
    for t in tasks:
        r = res["results"][PREFIX + t]
        out[t] = {"acc": float(r["acc,none"]), "acc_norm": float(r["acc_norm,none"]),
                  "n": int(res.get("n-samples", {}).get(PREFIX + t, {}).get("effective", 0))}
    return out
