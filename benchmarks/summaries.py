"""The numbers README.md and docs/evaluation.md quote, generated from the stored results (results.json of each
benchmark folder), so that a quoted number cannot drift from the run it comes from.

    python benchmarks/summaries.py           # rewrite every generated block from the stored results
    python benchmarks/summaries.py --check   # exit 1 naming each block that differs from them (what the test runs)

A generated block sits between the lines `<!-- generated: NAME -->` and `<!-- end: NAME -->` of a document in
DOCUMENTS; SECTIONS maps NAME to the function that renders it from the repository root. To add one (say a results
file of another benchmark): write `def my_section(root: Path) -> str`, add `"my-section": my_section` to SECTIONS,
and put the two marker lines where it goes. The paper's figure stands beside a row only where the paper measured
the same thing; `PAPER` holds them.
"""

import argparse
import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "docs/evaluation.md", "benchmarks/RESULTS.md")
PAPER_SMALL = Path("benchmarks/paper_small")
MODELS = ("DIFF", "DiffLlama", "Transformer")
SHOWN = {"DIFF": "DIFF", "DiffLlama": "DiffLlama", "Transformer": "Llama (Transformer)"}
NOT_STORED = "not stored"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: (?P=name) -->)", re.S)

# The paper's figures (arXiv 2410.05258, 3B-size models) for the rows that measure the same thing.
PAPER = {
    "answer, normalised": "DIFF 0.27-0.40, Transformer 0.03-0.09 (Table 3)",
    "noise, normalised": "DIFF 0.01-0.02, Transformer 0.49-0.54 (Table 3)",
    "top-1 attention logit": "DIFF 38.8, Transformer 318.0 (Table 5)",
    "top-1 hidden state": "DIFF 1688.2, Transformer 3608.6 (Table 5)",
    "logits at 4 bits": "zero-shot accuracy: DIFF kept, the Transformer's dropped (Figure 8)",
}
PAPER_TOKEN_RATIO = "~0.64 (the paper, Figure 3, 830M-13B parameters)"


def load_rows(root: Path, task_folder: str) -> list[dict]:
    return json.loads((root / PAPER_SMALL / task_folder / "results.json").read_text())["rows"]


# --- figures of one run: a float, or a str saying why there is none ---


def share(row: dict) -> float | str:
    total = row["answer"] + row["noise"]
    return row["answer"] / total if total else "undefined"


def stored(field: str) -> Callable[[dict], float | str]:
    def get(row: dict) -> float | str:
        if field not in row:
            return NOT_STORED
        return "every head excluded" if row[field] is None else row[field]
    return get


def at_cutoff(cutoff: str, field: str) -> Callable[[dict], float | str]:
    """The normalised `field` ("answer" / "noise") with the heads under `cutoff` in |row sum| left out."""
    def get(row: dict) -> float | str:
        if "by_threshold" not in row:
            return NOT_STORED
        value = row["by_threshold"][cutoff][field]
        return f"undefined (seed {row['seed']}: every head excluded)" if value is None else value
    return get


def outlier(kind: str, stat: str) -> Callable[[dict], float | str]:
    def get(row: dict) -> float | str:
        return row["outliers"][kind][stat] if kind in row["outliers"] else NOT_STORED
    return get


def pooled_top1(row: dict) -> float:
    """The top-1 attention logit over both branches: the stored pooled figure, or (exact) the larger branch top-1."""
    found = row["outliers"]
    if "attention logits" in found:
        return found["attention logits"]["top1"]
    return max(found[f"attention logits, branch {b}"]["top1"] for b in (1, 2))


def branch_one_ratio(row: dict) -> float | str:
    return outlier("attention logits, branch 1", "top1 / median")(row) if row["model"] != "Transformer" else "-"


def change_at(kind: str, bits: int) -> Callable[[dict], float]:
    def get(row: dict) -> float:
        return row["quantization"][kind][str(bits)] - row["quantization"]["none"]
    return get


def best_step(row: dict) -> int:
    return min(row["curve"], key=lambda point: point["val_loss"])["step"]


# --- formatting ---


def number(value: float | str, digits: int = 3, sign: bool = False) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):  # a step
        return f"{value:,}"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def cell(runs: list[dict], get: Callable, digits: int = 3, sign: bool = False) -> str:
    """mean ± sd over the runs (in seed order), then each run's figure; one run: its figure."""
    values = [get(r) for r in sorted(runs, key=lambda r: r["seed"])]
    if reasons := [v for v in values if isinstance(v, str)]:
        return reasons[0]
    each = ", ".join(number(v, digits, sign) for v in values)
    if len(values) == 1:
        return each
    return f"{number(statistics.mean(values), digits, sign)} ± {statistics.stdev(values):.{digits}f} ({each})"


def seeds(runs: list[dict]) -> str:
    found = sorted({r["seed"] for r in runs})
    return ("seed " if len(found) == 1 else "seeds ") + ", ".join(map(str, found))


def table(groups: list[tuple[str, list[dict]]], rows: list[tuple], paper: bool = True) -> list[str]:
    """Markdown: one line per (experiment, figure), one column per model, the paper's figure last where it measured
    the same thing. groups: (experiment title, its runs); rows: (experiment index, figure title, getter[, digits,
    sign, paper key])."""
    names = " | ".join(SHOWN[m] for m in MODELS)
    head = f"| experiment | figure | {names} |" + (" paper, same measurement |" if paper else "")
    out = [head, "|---|---|" + "---|" * (len(MODELS) + paper)]
    for index, title, get, *rest in rows:
        digits, sign, key = (rest + [3, False, None][len(rest):])[:3]
        name, runs = groups[index]
        cells = [cell([r for r in runs if r["model"] == m], get, digits, sign) for m in MODELS]
        out.append(f"| {name} | {title} | " + " | ".join(cells) + (f" | {PAPER.get(key, '')} |" if paper else " |"))
    return out


# --- the sections ---


# Training tokens of tiny Shakespeare as the text runs split it (90% of its 128-token blocks under their 1,024-token
# BPE): a property of the corpus (sha256 in results.json), not of a run.
SHAKESPEARE_TRAIN_TOKENS = 417_408


def experiments(root: Path) -> list[tuple[str, list[dict]]]:
    """(title, runs) of every stored paper_small report: text at its two lengths, retrieval."""
    text, retrieval = load_rows(root, "text"), load_rows(root, "retrieval")
    settings = json.loads((root / PAPER_SMALL / "text" / "results.json").read_text())["settings"]
    groups = []
    for task, rows in (("text", text), ("text-long", text), ("retrieval", retrieval)):
        runs = [r for r in rows if r["task"] == task]
        if task == "retrieval":
            groups.append((f"retrieval, {runs[0]['steps']:,} steps, {seeds(runs)}", runs))
            continue
        passes = runs[0]["steps"] * settings["text_batch"] * settings["text_block"] / SHAKESPEARE_TRAIN_TOKENS
        groups.append((f"tiny Shakespeare, {runs[0]['steps']:,} steps ({passes:.1f} passes), {seeds(runs)}", runs))
    return groups


def paper_small_figures(root: Path) -> str:
    groups = experiments(root)
    text, long, retrieval = 0, 1, 2
    cutoff = f"{groups[retrieval][1][0]['min_row_sum']:g}"
    others = [c for c in groups[retrieval][1][0]["by_threshold"] if c != cutoff]
    rows = [
        (text, "validation loss", lambda r: r["val_loss"]),
        (long, "validation loss at the end", lambda r: r["val_loss"]),
        (long, "best validation loss along training", lambda r: r["best_val_loss"]),
        (long, "step of the best", best_step, 0),
        (retrieval, "retrieval accuracy", lambda r: r["accuracy"]),
        (retrieval, f"answer, normalised (cut-off {cutoff})", stored("normalized_answer"), 3, False,
         "answer, normalised"),
        (retrieval, f"noise, normalised (cut-off {cutoff})", stored("normalized_noise"), 3, False, "noise, normalised"),
        *[(retrieval, f"{field}, normalised, cut-off {other}{' (every head kept)' if float(other) == 0 else ''}",
           at_cutoff(other, field)) for other in others for field in ("answer", "noise")],
        (retrieval, "answer, raw", lambda r: r["answer"]),
        (retrieval, "noise, raw", lambda r: r["noise"]),
        (retrieval, "share answer / (answer + noise)", share),
    ]
    for index in (text, long, retrieval):
        metric = "accuracy" if index == retrieval else "loss"
        rows += [
            (index, "top-1 attention logit, both branches", pooled_top1, 1, False, "top-1 attention logit"),
            (index, "top-1 / median attention logit, both branches", outlier("attention logits", "top1 / median"), 1),
            (index, "top-1 / median attention logit, branch 1 alone", branch_one_ratio, 1),
            (index, "top-1 hidden state", outlier("hidden states", "top1"), 1, False, "top-1 hidden state"),
            (index, "top-1 / median hidden state", outlier("hidden states", "top1 / median"), 1),
            (index, f"{metric} change, attention logits at 4 bits", change_at("attention logits", 4), 3, True,
             "logits at 4 bits"),
            (index, f"{metric} change, activations at 4 bits (not in the paper)", change_at("activations", 4), 3,
             True),
        ]
    body = table(groups, rows)
    missing = (" \"not stored\": the run predates the figure and its weights were not kept (see docs/evaluation.md)."
               if any(f"| {NOT_STORED} |" in line for line in body) else "")
    return "\n".join([
        "Mean ± sd over seeds, then each seed's figure in seed order. Attention at the answering position: "
        "normalised divides each head's row by its sum (1 - lambda; 1 for softmax) as the paper's Table 3 does, "
        f"leaving out the heads whose row sums to less than {cutoff} in magnitude (the cut-off; lambda near 1, where "
        f"the division would multiply the row by {1 / float(cutoff):g} or more); the rows at cut-offs "
        f"{' and '.join(others)} show how those figures move with it; raw is the map that multiplies V; share is "
        "raw answer / (raw answer + raw noise)." + missing, "", *body])


def per_run(root: Path, title: str, runs: list[dict], columns: list[tuple[str, Callable]]) -> list[str]:
    out = [f"{title}:", "", "| model | seed | " + " | ".join(c for c, _ in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for row in sorted(runs, key=lambda r: (MODELS.index(r["model"]), r["seed"])):
        out.append(f"| {row['model']} | {row['seed']} | " + " | ".join(number(get(row)) for _, get in columns) + " |")
    return out


def paper_small_text(root: Path) -> str:
    groups = experiments(root)
    (short_title, short), (long_title, long) = groups[0], groups[1]
    mean = {m: statistics.mean(r["val_loss"] for r in short if r["model"] == m) for m in MODELS}
    by = {r["model"]: r for r in long}
    llama = by["Transformer"]
    lines = [
        "Every model at Llama's initialisation (DIFF's embeddings unscaled) and one learning rate. "
        f"At {short[0]['steps']:,} steps ({seeds(short)}) the validation loss is DIFF {mean['DIFF']:.3f}, DiffLlama "
        f"{mean['DiffLlama']:.3f} and Llama {mean['Transformer']:.3f}. In the run of {long[0]['steps']:,} steps "
        f"({seeds(long)}), Llama reaches its best ({llama['best_val_loss']:.3f}) at step {best_step(llama):,} and ends "
        f"at {llama['val_loss']:.3f}; DIFF's best is {by['DIFF']['best_val_loss']:.3f} (step "
        f"{best_step(by['DIFF']):,}), its end {by['DIFF']['val_loss']:.3f}; DiffLlama's "
        f"{by['DiffLlama']['best_val_loss']:.3f} and {by['DiffLlama']['val_loss']:.3f}.", "",
    ]
    columns = [("val_loss", lambda r: r["val_loss"]), ("best_val_loss", lambda r: r["best_val_loss"]),
               ("step of the best", best_step)]
    return "\n".join(lines + per_run(root, short_title, short, columns) + [""]
                     + per_run(root, long_title, long, columns))


def paper_small_retrieval(root: Path) -> str:
    title, runs = experiments(root)[2]
    columns = [("val_loss", lambda r: r["val_loss"]), ("accuracy", lambda r: r["accuracy"]),
               ("answer, normalised", stored("normalized_answer")), ("noise, normalised", stored("normalized_noise")),
               ("answer, raw", lambda r: r["answer"]), ("noise, raw", lambda r: r["noise"]), ("share", share)]
    return "\n".join(per_run(root, title, runs, columns))


CONTROL_SHOWN = {"Llama-h": "Llama with DIFF's head count ({heads} heads of dim {dim})",
                 "DIFF-2h": "DIFF with Llama's head count ({heads} heads of q/k dim {dim})",
                 "DIFF-lambda0": "DIFF with lambda held at 0: its second branch disabled (no gradient to that "
                                 "branch's queries and keys)",
                 "DIFF-plus": "DIFF with A1 + lambda A2: only the sign changed",
                 "DIFF-lambda-frozen": "DIFF with lambda fixed at lambda_init (its lambda vectors get no gradient)",
                 "DIFF-noSubLN": "DIFF without SubLN",
                 "DIFF-V2": "DIFF V2 ({heads} heads of dim {dim}, no SubLN by design)"}


# paired by seed, at the chosen initialisation
GAPS_SHOWN = (("DIFF", "Llama"), ("DIFF", "Llama-h"), ("DIFF", "DIFF-lambda0"), ("DIFF", "DIFF-plus"),
              ("DIFF", "DIFF-lambda-frozen"), ("DIFF", "DIFF-noSubLN"),
              ("DIFF-noSubLN", "Llama-h"), ("DIFF-V2", "DIFF"), ("DIFF-V2", "Llama"))


def interval_cell(module, a: list[float], b: list[float]) -> str:
    gap = module.paired(a, b)
    low, high = gap["t90"]
    return f"{gap['mean']:+.3f} ± {gap['sd']:.3f}, 90% interval [{low:+.3f}, {high:+.3f}]"


def load_lm_scaling(root: Path) -> tuple:
    """(benchmarks/lm_scaling.py as a module, its results.json, the token-ratio statistics of its main runs)."""
    spec = importlib.util.spec_from_file_location("lm_scaling", root / "benchmarks" / "lm_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = json.loads((root / "benchmarks" / "lm_scaling" / "results.json").read_text())
    cfg, runs = results["config"], results["runs"]
    curves = {m: [runs["main"][m][str(seed)]["curve"] for seed in cfg["seeds"]] for m in module.MODELS}
    return module, results, module.analyse(curves, results["fit_skip"])


def single_pass_tokens(results: dict) -> int:
    """The training tokens of one lm_scaling run: its one pass over the corpus."""
    seed = results["config"]["seeds"][0]
    return results["runs"]["main"]["DIFF"][str(seed)]["curve"][-1]["tokens"]


def ratio_cell(module, stats: dict) -> str:
    ratio = stats["ratio"]["diff_over_llama"]
    return (f"{module.fmt_ratio(ratio['estimate'])}, 90% interval [{module.fmt_ratio(ratio['p05'])}, "
            f"{module.fmt_ratio(ratio['p95'])}]")


def lm_scaling(root: Path) -> str:
    """The single-epoch comparison (benchmarks/lm_scaling.py) from its results.json, with its own analysis code."""
    module, results, stats = load_lm_scaling(root)
    cfg, study = results["config"], results["studies"]["inits"]
    tokens = single_pass_tokens(results)
    seeds = ", ".join(str(seed) for seed in cfg["seeds"])
    cell = lambda values: "{mean:.3f} ± {sd:.3f}".format(**module.spread(values))
    lines = [f"One pass over {tokens:,} byte tokens of {results['corpus']['name']} {results['corpus']['version']}'s "
             f"source release, {results['parameters']['DIFF']:,} parameters, seeds {seeds} paired; every model and "
             "initialisation with its own learning-rate sweep. Initialisations (the same options for both families):",
             "", "| initialisation | DIFF final loss (LR) | Llama final loss (LR) | DIFF - Llama |",
             "|---|---|---|---|"]
    for init in (i for i in module.INITS if i in study):
        finals = {m: module.seed_finals(study[init][m]["seeds"], cfg) for m in module.MODELS}
        lines.append(f"| {init}{' (the default)' if init == module.PACKAGE_DEFAULT else ''} | "
                     + " | ".join(f"{cell(finals[m])} ({study[init][m]['lr']:g})" for m in module.MODELS)
                     + f" | {interval_cell(module, finals['DIFF'], finals['Llama'])} |")
    chosen = results["chosen_init"]
    finals = module.final_losses(results, chosen)
    lrs = {m: study[chosen][m]["lr"] for m in module.MODELS}
    lrs |= {m: entry["lr"] for m, entry in results["studies"]["controls"].items()}
    heading = (f"Controls at `{chosen}`, each with its own learning-rate sweep:" if results["studies"]["controls"]
               else f"At `{chosen}` (its controls are not in this results.json: `--without-controls`):")
    lines += ["", heading, "",
              "| model | parameters | learning rate | final validation loss | elsewhere, same measurement |",
              "|---|---|---|---|---|"]
    for name in (*module.MODELS, *(m for m in module.CONTROLS if m in finals)):
        _, heads, dim = module.head_layout(name, cfg)
        shown = f"{name}: {CONTROL_SHOWN[name].format(heads=heads, dim=dim)}" if name in CONTROL_SHOWN else name
        per_seed = ", ".join(f"{value:.3f}" for value in finals[name])
        lines.append(f"| {shown} | {results['parameters'][name]:,} | {lrs[name]:g} | {cell(finals[name])} "
                     f"({per_seed}) | |")
    for a, b in (pair for pair in GAPS_SHOWN if all(name in finals for name in pair)):
        elsewhere = (" -0.016 ± 0.023 nats at 30M parameters, 100M tokens, 4 seeds (an independent replication) "
                     if (a, b) == ("DIFF", "Llama") else " ")
        lines.append(f"| {a} - {b} | | | {interval_cell(module, finals[a], finals[b])} |{elsewhere}|")
    best = results["best_init"]
    lines.append(f"| tokens DIFF needs for Llama's final loss, over Llama's (each at its best initialisation: "
                 f"DIFF {best['DIFF']}, Llama {best['Llama']}) | | | {ratio_cell(module, stats)} "
                 f"(extrapolated fit) | {PAPER_TOKEN_RATIO} |")
    return "\n".join(lines)


def load_study(root: Path, task: str) -> dict | None:
    """benchmarks/paper_small/study/<task>/results.json (`paper_small.py --study`), or None where it is not run."""
    path = root / PAPER_SMALL / "study" / task / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def study_finals(found: dict, model: str, init: str, field: str = "val_loss") -> list[float]:
    """`field` of `model` at `init` per seed, in seed order (the study's main runs)."""
    runs = [r for r in found["rows"] if r["task"] == found["task"] and r["model"] == model and r["init"] == init]
    return [r[field] for r in sorted(runs, key=lambda r: r["seed"])]


def study_summary(module, found: dict) -> list[str]:
    """The text study's README lines: each family at its best initialisation, and DIFF - Llama at the package's
    default (same initialisation) and each at its best."""
    best, inits = found["best_init"], list(found["sweep"])
    seeds = sorted({r["seed"] for r in found["rows"] if r["task"] == found["task"]})
    cell = lambda values: "{mean:.3f} ± {sd:.3f}".format(**module.spread(values))
    at_best = ", ".join(f"{'Llama' if m == 'Transformer' else m} {cell(study_finals(found, m, best[m]))} "
                        f"(`{best[m]}`, LR {found['lr'][best[m]][m]:g})" for m in MODELS)
    steps = found["rows"][0]["steps"]
    lines = [f"- Small-scale reproduction on text, every family at each initialisation "
             f"({', '.join(f'`{i}`' for i in inits)}) with its own learning-rate sweep (`benchmarks/paper_small.py "
             f"--study --tasks text`: tiny Shakespeare, {steps:,} steps, seeds {', '.join(map(str, seeds))}):",
             f"  - validation loss, each at its best: {at_best}"]
    pairs = [(f"both at `{init}`{' (the default)' if init == module.PACKAGE_DEFAULT else ''}", init, init)
             for init in (module.PACKAGE_DEFAULT, module.BASE_INIT) if init in inits]
    pairs.append((f"each at its best (DIFF `{best['DIFF']}`, Llama `{best['Transformer']}`)", best["DIFF"],
                  best["Transformer"]))
    for what, diff_init, llama_init in pairs:
        lines.append(f"  - validation loss, DIFF - Llama, {what}: " + interval_cell(
            module, study_finals(found, "DIFF", diff_init), study_finals(found, "Transformer", llama_init)))
    return lines


def paper_small_study(root: Path) -> str:
    """The text study (`paper_small.py --study`) as one table: per initialisation each family's final validation
    loss (mean ± sd over seeds, its swept learning rate) and DIFF - Llama at that initialisation."""
    module, _, _ = load_lm_scaling(root)
    found = load_study(root, "text")
    if found is None:
        return "Not run yet: `python benchmarks/paper_small.py --study --tasks text`."
    cell = lambda values: "{mean:.3f} ± {sd:.3f}".format(**module.spread(values))
    lines = [f"Generated from benchmarks/paper_small/study/text/results.json (`{found['command']}`).", "",
             "| initialisation | DIFF (LR) | DiffLlama (LR) | Llama (LR) | DIFF - Llama |", "|---|---|---|---|---|"]
    for init in found["sweep"]:
        finals = {m: study_finals(found, m, init) for m in MODELS}
        lines.append(f"| {init}{' (the default)' if init == module.PACKAGE_DEFAULT else ''} | " + " | ".join(
            f"{cell(finals[m])} ({found['lr'][init][m]:g})" for m in MODELS)
            + f" | {interval_cell(module, finals['DIFF'], finals['Transformer'])} |")
    best, run = found["best_init"], list(found["sweep"])
    if len(run) > 1:
        lines += ["", "Each family's best initialisation (lowest mean validation loss): " + ", ".join(
            f"{'Llama' if m == 'Transformer' else m} `{best[m]}`" for m in MODELS) + "."]
    missing = [init for init in module.INITS if init not in run]
    notes = []
    if missing:
        notes.append(f"Not run yet: {', '.join(f'`{i}`' for i in missing)} (the same command with `--inits` naming "
                     "them)" + ("" if len(run) > 1 else ", and so no family's best initialisation; the README quotes "
                                "the study once it has more than one") + ".")
    long = {r["model"]: r for r in found["rows"] if r["task"] == "text-long"}
    if not long:
        notes.append("The long run (`--long-steps`: each family at its best initialisation and rate, one seed) is not "
                     "in it (`--long-steps 0`).")
    else:
        lines += ["", study_long_run(found, long)]
    return "\n".join(lines + (["", " ".join(notes)] if notes else []))


def study_long_run(found: dict, long: dict) -> str:
    """The study's long run in a sentence: each family's loss at the end and at its lowest, and where that was."""
    run = next(iter(long.values()))
    passes = run["steps"] * found["batch"] / found["train_sequences"]
    names = [m for m in MODELS if m in long]
    figures = lambda get: ", ".join(f"{'Llama' if m == 'Transformer' else m} {get(long[m]):.3f}" for m in names)
    return (f"The long run ({run['steps']:,} steps, {passes:.1f} passes over the training blocks, seed {run['seed']}, "
            f"each family at its best initialisation and rate; one seed, so no interval): validation loss at the end "
            f"{figures(lambda r: r['val_loss'])}; lowest along training {figures(lambda r: r['best_val_loss'])}, at "
            f"step {' / '.join(f'{s:,}' for s in sorted({best_step(long[m]) for m in names}))}"
            + (", and higher after it: the long run overfits the small file." if all(
                long[m]["val_loss"] > long[m]["best_val_loss"] for m in names) else "."))


def models_cell(runs: list[dict], get: Callable, digits: int = 3) -> str:
    """'DIFF x ± s, DiffLlama y ± s, Llama z ± s': each model's mean ± sd over its seeds."""
    out = []
    for model in MODELS:
        values = [get(r) for r in runs if r["model"] == model]
        figure = f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
        out.append(f"{'Llama' if model == 'Transformer' else model} {figure}")
    return ", ".join(out)


def readme_summary(root: Path) -> str:
    """The README's few lines of evidence: the headline figure of each experiment, each line naming the
    initialisation of both sides; the tables are in docs/evaluation.md."""
    (text_title, text), _, (retrieval_title, retrieval) = experiments(root)
    params = sorted({r["params"] for r in text + retrieval})
    module, results, stats = load_lm_scaling(root)
    cfg, chosen, best = results["config"], results["chosen_init"], results["best_init"]
    finals = module.final_losses(results, chosen)
    tokens = single_pass_tokens(results)
    seeds = ", ".join(map(str, cfg["seeds"]))
    at = lambda init: f"`{init}`{' (the default)' if init == module.PACKAGE_DEFAULT else ''}"
    lines = [
        *(study_summary(module, found) if (found := load_study(root, "text")) and len(found["sweep"]) > 1 else []),
        f"- Small-scale reproduction (`benchmarks/paper_small.py`, {params[0] / 1e6:.2f}-{params[-1] / 1e6:.2f}M "
        f"parameters), all three families at Llama's initialisation ({at(module.BASE_INIT)}: DIFF's embeddings "
        "unscaled, not the package's default; one learning rate for all), mean ± sd over seeds:",
        f"  - {text_title}: validation loss {models_cell(text, lambda r: r['val_loss'])}",
        f"  - {retrieval_title}: accuracy {models_cell(retrieval, lambda r: r['accuracy'])}",
        f"  - {text_title}: top-1 / median hidden state (§3.8) "
        f"{models_cell(text, outlier('hidden states', 'top1 / median'), 1)}",
        f"- Single epoch (`benchmarks/lm_scaling.py`, {results['parameters']['DIFF']:,} parameters, one pass over "
        f"{tokens:,} byte tokens, seeds {seeds} paired, every model and initialisation with its own learning-rate "
        "sweep):",
        f"  - final validation loss, DIFF - Llama, both at {at(chosen)}: "
        f"{interval_cell(module, finals['DIFF'], finals['Llama'])}",
    ]
    if best["DIFF"] != chosen or best["Llama"] != chosen:
        main = module.final_losses(results)
        lines.append(f"  - final validation loss, DIFF - Llama, each at its best (DIFF `{best['DIFF']}`, Llama "
                     f"`{best['Llama']}`): {interval_cell(module, main['DIFF'], main['Llama'])}")
    for name, what in README_CONTROLS:
        if name in finals:
            lines.append(f"  - final validation loss, DIFF - {name} ({what}), both at {at(chosen)}: "
                         f"{interval_cell(module, finals['DIFF'], finals[name])}")
    lines.append(f"  - tokens DIFF needs for Llama's final loss, over Llama's, each at its best (DIFF "
                 f"`{best['DIFF']}`, Llama `{best['Llama']}`): {ratio_cell(module, stats)}; {PAPER_TOKEN_RATIO}")
    return "\n".join(lines)


# The controls the README quotes against DIFF, with what each changes.
README_CONTROLS = (("DIFF-lambda0", "lambda held at 0: the second branch disabled, its queries and keys get no "
                                    "gradient"),
                   ("DIFF-plus", "A1 + lambda A2: only the sign changed"),
                   ("DIFF-lambda-frozen", "lambda fixed at lambda_init, not learned"))


SECTIONS: dict[str, Callable[[Path], str]] = {
    "lm-scaling": lm_scaling,
    "paper-small-figures": paper_small_figures,
    "paper-small-text": paper_small_text,
    "paper-small-retrieval": paper_small_retrieval,
    "paper-small-study": paper_small_study,
    "readme-summary": readme_summary,
}


def render(root: Path, text: str) -> str:
    """`text` with every generated block rewritten; an unknown block name is an error."""
    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in SECTIONS:
            raise SystemExit(f"error: no section {name!r} in benchmarks/summaries.py SECTIONS ({', '.join(SECTIONS)})")
        return f"{match[1]}{SECTIONS[name](root)}\n{match[4]}"
    return BLOCK.sub(block, text)


def stale(root: Path) -> list[str]:
    """'document: block' for each generated block that differs from what the stored results give."""
    out = []
    for document in DOCUMENTS:
        text = (root / document).read_text()
        fresh = render(root, text)
        current = {m["name"]: m["body"] for m in BLOCK.finditer(text)}
        out += [f"{document}: {m['name']}" for m in BLOCK.finditer(fresh) if current[m["name"]] != m["body"]]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        if found := stale(args.root):
            print("out of date (run python benchmarks/summaries.py): " + "; ".join(found), file=sys.stderr)
            return 1
        return 0
    from diff_transformer.tools.safe_write import write_text  # rendering imports torch already (lm_scaling)

    for document in DOCUMENTS:
        path = args.root / document
        write_text(path, render(args.root, path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
