"""Evaluations of the Differential Transformer paper (Ye et al., arXiv 2410.05258) for any causal LM + tokenizer.

- Multi-needle retrieval (§3.4, Fig. 5): N needles "The magic number of <city> is <number>." in filler text, R of
  them queried, the queried needles placed at a given depth; greedy accuracy per (context length, depth).
- Attention noise (Table 3): the attention the answering (last) position gives to the answer needle versus to the
  rest of the context, three ways (`allocation`). Normalised, the paper's ("we compare the normalized attention
  scores", §3.4): each head's row divided by its sum (1 - lambda for the differential map A1 - lambda A2, 1 for a
  softmax), averaged over heads and layers; heads whose row sums to less than `MIN_ROW_SUM` in magnitude (lambda near
  1) are excluded and listed. Raw: the map as it multiplies V, averaged the same way (a differential row may be
  negative). Share: raw answer / (raw answer + raw noise), which a common scale of the rows leaves unchanged.
- Activation outliers (Table 5): top-k magnitudes of attention logits (q k^T / sqrt(d), causal entries; both
  branches pooled, and each branch apart for differential models) and of hidden states (every decoder layer's output,
  the residual stream after each layer; not the final norm's output) against the exact median of all of them.

The pictures (with matplotlib) draw exactly the arrays that pure functions return: `needle_grid` (accuracy by length
and depth) and `noise_heatmaps` (per layer the answering position's row over the key positions: the differential map,
each branch, and each other model's map, as in the paper's Figure 1).
"""

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from ..kernel_common import split_branches
from ..attention_kernels import capture_branch_attentions
from ..modeling_diff import DiffAttention

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CITIES = (
    "Paris Lisbon Berlin Madrid Rome Vienna Prague Oslo Dublin Athens Cairo Lagos Nairobi Lima Quito Bogota Havana "
    "Toronto Denver Boston Chicago Seattle Austin Tokyo Osaka Seoul Beijing Delhi Mumbai Dhaka Manila Jakarta Hanoi "
    "Sydney Perth Auckland Moscow Warsaw Riga Helsinki"
).split()
FILLER = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river flows to the sea.", "Birds sing in the morning.", "The road is long and quiet.",
)


@dataclass
class NeedleSettings:
    """The paper's multi-needle protocol in small: N needles, R queried, depths in percent, lengths in tokens."""

    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0, 25, 50, 75, 100])
    needles: int = 6
    queries: int = 2
    samples: int = 5
    seed: int = 0
    digits: int = 4

    def __post_init__(self):
        check(self.lengths and min(self.lengths) > 0, f"lengths must be positive token counts, got {self.lengths}")
        check(self.depths and all(0 <= d <= 100 for d in self.depths),
                f"depths are percentages between 0 and 100, got {self.depths}")
        check(1 <= self.needles <= len(CITIES),
                f"needles must be between 1 and {len(CITIES)} (one city each), got {self.needles}")
        check(1 <= self.queries <= self.needles,
                f"queries must be between 1 and needles ({self.needles}): the queried needles are among them, "
                f"got {self.queries}")
        check(self.samples >= 1 and self.digits >= 1, f"samples and digits must be >= 1, got {self.samples}, "
                f"{self.digits}")


@dataclass
class NeedlePrompt:
    context: str
    answers: list[tuple[str, str]]  # (city, number) of the queried needles
    spans: list[tuple[int, int]]  # character span of each queried needle in `context`

    def question(self, index: int) -> str:
        city = self.answers[index][0]
        return f"{self.context} What is the magic number of {city}? The magic number of {city} is"


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def needle(city: str, number: str) -> str:
    return f"The magic number of {city} is {number}."


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, name: str | None = None) -> None:
    """A word-level tokenizer (such as the synthetic task's) maps the prompts to <unk>, and every answer scores 0;
    `name` (the model's folder) is named in the error."""
    sample = needle(CITIES[0], "1234")
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    check(tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids,
            f"the tokenizer{f' of {name}' if name else ''} cannot encode the needle text ({sample!r} becomes "
            f"{tokenizer.decode(ids)!r}); use a model whose tokenizer covers English text, e.g. one trained with "
            "`diff-transformer train --data FILE`")


def check_same_encoding(tokenizer: PreTrainedTokenizerBase, other: PreTrainedTokenizerBase, name: str,
                        other_name: str) -> None:
    """Models compared on one prompt must read the same tokens: `other` (a baseline's tokenizer) encodes a needle,
    the filler and the question as `tokenizer` does."""
    text = " ".join([needle(CITIES[0], "1234"), *FILLER, f"What is the magic number of {CITIES[0]}?"])
    ids, other_ids = (t(text, add_special_tokens=False)["input_ids"] for t in (tokenizer, other))
    if ids == other_ids:
        return
    at = next((i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b), min(len(ids), len(other_ids)))
    raise ValueError(
        f"the tokenizer of {other_name} encodes the evaluation text differently from {name}'s ({len(other_ids)} vs "
        f"{len(ids)} tokens, first difference at token {at}: {other.decode(other_ids[at : at + 1])!r} vs "
        f"{tokenizer.decode(ids[at : at + 1])!r}); compare models that share a tokenizer: save the model's with "
        f"tokenizer.save_pretrained({other_name!r}) when the baseline was trained on its ids"
    )


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, prompt: NeedlePrompt, queries: int) -> int:
    """Tokens of the longest question prompt, special tokens included (what the model reads)."""
    return max(len(tokenizer(prompt.question(i))["input_ids"]) for i in range(queries))


def filler_sentences(tokenizer: PreTrainedTokenizerBase, length: int, rng: random.Random) -> list[str]:
    """Random filler sentences totalling at most `length` tokens (and within one sentence of it)."""
    sentences, total = [], 0
    while True:
        sentence = rng.choice(FILLER)
        size = len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
        if total + size > length:
            return sentences
        sentences.append(sentence)
        total += size


def place_needles(sentences: list[str], needles: list[tuple[str, str]], depth: float, settings: NeedleSettings,
                  rng: random.Random) -> NeedlePrompt:
    """The unqueried needles at random places, the R queried ones together at `depth` percent."""
    for city, number in needles[settings.queries :]:
        sentences.insert(rng.randrange(len(sentences) + 1), needle(city, number))
    at = round(depth / 100 * len(sentences))
    answers = needles[: settings.queries]
    sentences[at:at] = [needle(c, n) for c, n in answers]
    context = " ".join(sentences)
    spans = [(context.index(needle(c, n)), context.index(needle(c, n)) + len(needle(c, n))) for c, n in answers]
    return NeedlePrompt(context, answers, spans)


def build_needle_prompt(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, settings: NeedleSettings, rng: random.Random
) -> NeedlePrompt:
    """Filler with N needles, the R queried ones together at `depth` percent; each question prompt (context and
    question, special tokens included) has at most `length` tokens, and at least `length` minus one filler
    sentence."""
    check_tokenizer(tokenizer)
    cities = rng.sample(CITIES, settings.needles)
    needles = [(city, str(rng.randrange(10 ** (settings.digits - 1), 10**settings.digits))) for city in cities]
    budget = length - prompt_tokens(tokenizer, place_needles([], needles, depth, settings, rng), settings.queries)
    state = rng.getstate()
    while budget >= 0:
        prompt = place_needles(filler_sentences(tokenizer, budget, rng), needles, depth, settings, rng)
        excess = prompt_tokens(tokenizer, prompt, settings.queries) - length
        if excess <= 0:
            return prompt
        budget -= excess  # sentences joined in the context may tokenize a little longer than counted one by one
        rng.setstate(state)
    raise ValueError(
        f"a {length}-token prompt cannot hold {settings.needles} needles and the question "
        f"({length - budget} tokens with this tokenizer); use a longer length or fewer needles"
    )


def answer_correct(model, tokenizer: PreTrainedTokenizerBase, prompt: str, number: str) -> bool:
    """Greedy continuation starts with the number."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    steps = len(tokenizer(" " + number, add_special_tokens=False)["input_ids"]) + 1
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip().startswith(number)


def cell_accuracy(model, tokenizer: PreTrainedTokenizerBase, settings: NeedleSettings, length: int, depth: float,
                  bar: tqdm) -> float:
    """Share of the queried needles answered correctly over `samples` prompts seeded by (seed, length, depth)."""
    rng = random.Random(f"{settings.seed}-{length}-{depth}")
    prompts = [build_needle_prompt(tokenizer, length, depth, settings, rng) for _ in range(settings.samples)]
    hits = []
    for prompt in prompts:
        for i in range(settings.queries):
            hits.append(answer_correct(model, tokenizer, prompt.question(i), prompt.answers[i][1]))
            bar.update()
    return sum(hits) / len(hits)


def needle_accuracy(
    model, tokenizer: PreTrainedTokenizerBase, settings: NeedleSettings, progress: bool = False
) -> dict:
    """{(length, depth): share of queried needles answered correctly} over `samples` seeded prompts each;
    `progress` shows a bar of prompts done out of the total."""
    total = len(settings.lengths) * len(settings.depths) * settings.samples * settings.queries
    with tqdm(total=total, desc="needle prompts", unit="prompt", disable=not progress) as bar:
        return {(length, depth): cell_accuracy(model, tokenizer, settings, length, depth, bar)
                for length in settings.lengths for depth in settings.depths}


def accuracy_table(results: dict, settings: NeedleSettings) -> str:
    """Markdown: one row per context length, one column per depth."""
    header = "| length \\ depth | " + " | ".join(f"{d:g}%" for d in settings.depths) + " | mean |"
    lines = [header, "|" + "---|" * (len(settings.depths) + 2)]
    for length in settings.lengths:
        row = [results[(length, d)] for d in settings.depths]
        lines.append(f"| {length} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {sum(row) / len(row):.2f} |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PLOT_DPI = 100  # the PNGs are figsize x PLOT_DPI pixels (no tight cropping)


def needle_grid(results: dict, settings: NeedleSettings) -> np.ndarray:
    """The accuracy heatmap's data [lengths, depths]: row i is settings.lengths[i], column j settings.depths[j],
    the cells of `accuracy_table` in its order."""
    return np.array([[results[(length, d)] for d in settings.depths] for length in settings.lengths], dtype=float)


def save_heatmap(results: dict, settings: NeedleSettings, path: str | Path, title: str) -> "Figure | None":
    """Write the accuracy heatmap (`needle_grid`: lengths down, depths across, each cell's value printed) and return
    its matplotlib Figure; None (nothing written) when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    grid = needle_grid(results, settings)
    size = (1.2 * len(settings.depths) + 2, 0.6 * len(settings.lengths) + 2)
    fig, ax = plt.subplots(figsize=size, dpi=PLOT_DPI, layout="constrained")
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(settings.depths)), [f"{d:g}%" for d in settings.depths])
    ax.set_yticks(range(len(settings.lengths)), [str(n) for n in settings.lengths])
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center")
    ax.set(xlabel="answer depth", ylabel="context length (tokens)", title=title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return fig


def needle_table(results: dict, settings: NeedleSettings, name: str) -> str:
    """The title and the accuracy table of `needle_accuracy`'s results for model `name`."""
    return f"{needle_title(settings, name)}\n\n{accuracy_table(results, settings)}"


def needle_title(settings: NeedleSettings, name: str) -> str:
    return f"multi-needle N={settings.needles} R={settings.queries}: {name}"


def span_positions(tokenizer: PreTrainedTokenizerBase, text: str, prompt: NeedlePrompt) -> dict[str, torch.Tensor]:
    """Token ids, and the positions of the answer needle and of the rest of the context."""
    encoded = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded["offset_mapping"][0]
    start, end = prompt.spans[0]
    real = offsets[:, 1] > offsets[:, 0]  # special tokens have empty offsets
    answer = real & (offsets[:, 0] < end) & (offsets[:, 1] > start)
    context = real & (offsets[:, 1] <= len(prompt.context))
    return {"input_ids": encoded["input_ids"], "answer": answer, "noise": context & ~answer}


def diffllama_branches(model, maps: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(A1 [B, h, T, S], A2, lambda) per layer of transformers' DiffLlama from its `output_attentions`, which holds
    softmax(Q K^T) of all 2h heads: its output subtracts lambda times the second half of the heads from the first."""
    branches = []
    for layer, attention in zip(model.model.layers, maps):
        a1, a2 = attention.float().chunk(2, dim=1)  # [B, 2h, T, S] -> 2 x [B, h, T, S]
        branches.append((a1, a2, diffllama_lambda(layer.self_attn)))
    return branches


def diffllama_lambda(module: torch.nn.Module) -> torch.Tensor:
    """lambda of one DiffLlama attention layer, as its forward computes it."""
    lambda_1 = torch.exp((module.lambda_q1 * module.lambda_k1).sum())
    lambda_2 = torch.exp((module.lambda_q2 * module.lambda_k2).sum())
    return (lambda_1 - lambda_2 + module.lambda_init).detach().float()


def attention_maps(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
    """Per layer the map that multiplies V [B, heads, T, S], and (A1, A2, lambda) of differential layers: ours
    through `capture_branch_attentions`, transformers' DiffLlama's from its attention outputs (eager models)."""
    with torch.no_grad(), capture_branch_attentions(model) as branches:
        maps = [m.float() for m in model(input_ids.to(model.device), output_attentions=True).attentions]
    if model.config.model_type == "diffllama":
        branches = diffllama_branches(model, maps)
        maps = [a1 - lam * a2 for a1, a2, lam in branches]
    return maps, branches


def last_row_maps(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
    """The last position's row of every head per layer [heads, S], and head-averaged (A1, lambda A2) rows [S] of
    differential layers."""
    maps, branches = attention_maps(model, input_ids)
    rows = [m[0, :, -1].cpu() for m in maps]
    branch_rows = [(a1[0, :, -1].mean(0).cpu(), (lam * a2[0, :, -1]).mean(0).cpu()) for a1, a2, lam in branches]
    return rows, branch_rows


MIN_ROW_SUM = 0.1  # a head whose row sums to less (|1 - lambda|, lambda near 1) is not normalised: 1 / 0.1 = 10x


def allocation(head_rows: list[torch.Tensor], answer: torch.Tensor, noise: torch.Tensor,
               min_row_sum: float = MIN_ROW_SUM) -> dict:
    """Attention to the answer and to the noise from per-layer rows of every head [heads, S] and boolean masks [S].

    Per layer: "answer" / "noise" (raw: the head mean of the weight on those keys), "row_sum" (head mean of the row
    sums), "normalized_answer" / "normalized_noise" (head mean of each head's weight divided by its row sum, over the
    heads kept; None when none is). Overall: "mean_answer" / "mean_noise" (raw, over heads and layers),
    "mean_normalized_answer" / "mean_normalized_noise" (over every kept head of every layer; None when none is kept),
    "share" = mean_answer / (mean_answer + mean_noise) (None when that sum is 0) and "excluded": (layer, head, row
    sum) of the heads whose |row sum| < min_row_sum."""
    answers = [row[:, answer].sum(-1) for row in head_rows]  # per layer [heads]
    noises = [row[:, noise].sum(-1) for row in head_rows]
    sums = [row.sum(-1) for row in head_rows]
    kept = [s.abs() >= min_row_sum for s in sums]
    excluded = [(layer, head, sums[layer][head].item())
                for layer, k in enumerate(kept) for head in (~k).nonzero()[:, 0].tolist()]

    def normalized(values: list[torch.Tensor]) -> tuple[list[float | None], float | None]:
        per_layer = [(v / s)[k].mean().item() if k.any() else None for v, s, k in zip(values, sums, kept)]
        pooled = torch.cat([(v / s)[k] for v, s, k in zip(values, sums, kept)])
        return per_layer, pooled.mean().item() if pooled.numel() else None

    (norm_answer, mean_norm_answer), (norm_noise, mean_norm_noise) = normalized(answers), normalized(noises)
    mean_answer = torch.cat(answers).mean().item()
    mean_noise = torch.cat(noises).mean().item()
    total = mean_answer + mean_noise
    return {
        "answer": [a.mean().item() for a in answers], "noise": [n.mean().item() for n in noises],
        "row_sum": [s.mean().item() for s in sums], "normalized_answer": norm_answer,
        "normalized_noise": norm_noise, "mean_answer": mean_answer, "mean_noise": mean_noise,
        "mean_normalized_answer": mean_norm_answer, "mean_normalized_noise": mean_norm_noise,
        "share": mean_answer / total if total != 0 else None, "excluded": excluded, "min_row_sum": min_row_sum,
    }


ROW_SUM_THRESHOLDS = (0.0, MIN_ROW_SUM, 0.2)  # the cut-offs the reports compare: none, the one used, twice it


def threshold_sweep(head_rows: list[torch.Tensor], answer: torch.Tensor, noise: torch.Tensor,
                    thresholds: tuple[float, ...] = ROW_SUM_THRESHOLDS) -> dict[str, dict]:
    """How the normalised figures move with the cut-off on |row sum|: per threshold t (key f"{t:g}") `allocation`'s
    "answer" / "noise" (its mean normalised answer and noise with min_row_sum t; None when every head is excluded)
    and "excluded" ([layer, head] of the heads left out). At 0 every head is kept."""
    sweep = {}
    for threshold in thresholds:
        report = allocation(head_rows, answer, noise, threshold)
        sweep[f"{threshold:g}"] = {"answer": report["mean_normalized_answer"],
                                   "noise": report["mean_normalized_noise"],
                                   "excluded": [[layer, head] for layer, head, _ in report["excluded"]]}
    return sweep


def attention_noise(model, tokenizer: PreTrainedTokenizerBase, prompt: NeedlePrompt,
                    min_row_sum: float = MIN_ROW_SUM) -> dict:
    """`allocation` of the answering position's attention to the answer needle and to the rest of the context
    (the question excluded), plus "by_threshold" (`threshold_sweep`), "rows" (head-averaged row per layer [S]),
    "branch_rows" and "positions" (eager models)."""
    check(model.config._attn_implementation == "eager",
            f"attention_noise reads attention maps, which only eager attention returns, but the model runs "
            f"'{model.config._attn_implementation}': load it with attn_implementation=\"eager\" or call "
            "model.set_attn_implementation(\"eager\") first")
    positions = span_positions(tokenizer, prompt.question(0), prompt)
    head_rows, branch_rows = last_row_maps(model, positions["input_ids"])
    report = allocation(head_rows, positions["answer"], positions["noise"], min_row_sum)
    return {**report, "by_threshold": threshold_sweep(head_rows, positions["answer"], positions["noise"]),
            "rows": [row.mean(0) for row in head_rows], "branch_rows": branch_rows, "positions": positions}


def figure(value: float | None) -> str:
    return "excluded" if value is None else f"{value:.3f}"


def excluded_heads(report: dict) -> str:
    return ", ".join(f"layer {layer} head {head} ({total:.3f})" for layer, head, total in report["excluded"]) or "none"


def noise_table(reports: dict[str, dict]) -> str:
    """Markdown: per model the normalised (the paper's), raw and share figures with the excluded heads; then per layer
    each model's row sum and normalised and raw answer / noise."""
    limit = next(iter(reports.values()))["min_row_sum"]
    lines = ["Attention of the answering position (paper Table 3). normalised: each head's row divided by its sum "
             "(1 - lambda; 1 for softmax), averaged over heads and layers, the paper's comparison; raw: the map that "
             "multiplies V; share: raw answer / (raw answer + raw noise).", "",
             f"| model | answer, normalised | noise, normalised | answer, raw | noise, raw | share | heads excluded "
             f"(\\|row sum\\| < {limit:g}) |", "|---|---|---|---|---|---|---|"]
    for name, r in reports.items():
        lines.append(f"| {name} | {figure(r['mean_normalized_answer'])} | {figure(r['mean_normalized_noise'])} | "
                     f"{r['mean_answer']:.3f} | {r['mean_noise']:.3f} | {figure(r['share'])} | {excluded_heads(r)} |")
    names = list(reports)
    layers = max(len(r["answer"]) for r in reports.values())
    columns = ("row sum", "answer, normalised", "noise, normalised", "answer, raw", "noise, raw")
    lines += ["", "| layer | " + " | ".join(f"{n} {c}" for n in names for c in columns) + " |",
              "|---|" + "---|" * (len(columns) * len(names))]
    for i in range(layers):
        cells = [" | ".join([f"{r['row_sum'][i]:.3f}", figure(r["normalized_answer"][i]),
                             figure(r["normalized_noise"][i]), f"{r['answer'][i]:.3f}", f"{r['noise'][i]:.3f}"])
                 if i < len(r["answer"]) else " | ".join("-" * len(columns)) for r in reports.values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", *threshold_table(reports, limit)])


def threshold_table(reports: dict[str, dict], limit: float) -> list[str]:
    """Markdown: per cut-off on |row sum| (`threshold_sweep`) each model's normalised answer and noise and the number
    of heads left out."""
    names = list(reports)
    lines = [f"Normalised figures by the cut-off on |row sum| (heads under it left out; the tables above use "
             f"{limit:g}; \"excluded\": every head is):", "",
             "| cut-off | " + " | ".join(f"{n} {c}" for n in names for c in ("answer", "noise", "heads left out"))
             + " |", "|---|" + "---|" * (3 * len(names))]
    for threshold in next(iter(reports.values()))["by_threshold"]:
        cells = [f"{figure(s['answer'])} | {figure(s['noise'])} | {len(s['excluded'])}"
                 for s in (r["by_threshold"][threshold] for r in reports.values())]
        lines.append(f"| {threshold} | " + " | ".join(cells) + " |")
    return lines


@dataclass
class Heatmap:
    """One panel of the attention-noise figure: the answering position's head-averaged attention row per layer."""

    values: np.ndarray  # [layers, keys]
    kind: str  # "differential" (A1 - lambda A2: signed, rows sum to 1 - lambda) or "weights" (A1, lambda A2, softmax)
    answer: tuple[int, int]  # key positions [start, end) of the answer needle
    question: int  # the first key position after the context (the question, which the table does not count)


def answer_span(report: dict) -> tuple[int, int]:
    """[first, last + 1) of the answer needle's key positions in an `attention_noise` report."""
    positions = report["positions"]["answer"].nonzero().flatten()
    return positions.min().item(), positions.max().item() + 1


def question_start(report: dict) -> int:
    """The first key position after the context (answer and noise) in an `attention_noise` report."""
    positions = report["positions"]
    return (positions["answer"] | positions["noise"]).nonzero().max().item() + 1


def noise_heatmaps(reports: dict[str, dict]) -> dict[str, Heatmap]:
    """The attention-noise figure's data, {panel title: Heatmap}, from `attention_noise` reports: per differential
    model its map A1 - lambda A2 ("rows", what the table sums), branch 1 (A1) and branch 2 (lambda A2); per other
    model its softmax map. Rows are layers, columns key positions; heads are averaged as the table's raw figures are,
    so a row's sum over the answer positions is the table's raw answer for that layer."""
    panels = {}
    for name, report in reports.items():
        span, question = answer_span(report), question_start(report)
        rows = np.stack([row.float().numpy() for row in report["rows"]])  # L x [S] -> [L, S]
        if not report["branch_rows"]:
            panels[f"{name}: softmax map"] = Heatmap(rows, "weights", span, question)
            continue
        branch_1, branch_2 = (np.stack([pair[b].float().numpy() for pair in report["branch_rows"]]) for b in (0, 1))
        panels[f"{name}: A1 - lambda A2 (differential map)"] = Heatmap(rows, "differential", span, question)
        panels[f"{name}: A1 (branch 1)"] = Heatmap(branch_1, "weights", span, question)
        panels[f"{name}: lambda A2 (branch 2)"] = Heatmap(branch_2, "weights", span, question)
    return panels


NOISE_COLOURS = {  # per panel kind: colour map and whether its scale is symmetric about 0
    "differential": ("RdBu_r", True), "weights": ("magma", False)}


def colour_limits(panels: dict[str, Heatmap]) -> dict[str, tuple[float, float]]:
    """One colour scale per panel kind over all its panels: [0, max] for weights (from the minimum if below 0: a
    negative lambda makes lambda A2 negative), [-m, m] (m = max |value|) for differential maps, so that equal colours
    are equal weights across models and branches."""
    limits = {}
    for kind, (_, symmetric) in NOISE_COLOURS.items():
        values = [p.values for p in panels.values() if p.kind == kind]
        if values:
            top = max(float(np.abs(v).max()) for v in values) or 1.0
            limits[kind] = (-top, top) if symmetric else (min(0.0, min(float(v.min()) for v in values)), top)
    return limits


def save_noise_plot(reports: dict[str, dict], path: str | Path) -> "Figure | None":
    """Write the attention-noise heatmaps (`noise_heatmaps`, one panel each, in its order; the answer needle outlined,
    the question after a dashed line; one colour scale per kind) and return the matplotlib Figure; None (nothing
    written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.patches import Rectangle

    panels, images = noise_heatmaps(reports), {}
    limits = colour_limits(panels)
    height = sum(0.3 * len(p.values) + 0.8 for p in panels.values()) + 0.8
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, height), dpi=PLOT_DPI, sharex=True, squeeze=False,
                             layout="constrained", height_ratios=[len(p.values) + 2 for p in panels.values()])
    for ax, (title, panel) in zip(axes[:, 0], panels.items()):
        layers = len(panel.values)
        images.setdefault(panel.kind, []).append(ax.imshow(
            panel.values, cmap=NOISE_COLOURS[panel.kind][0], vmin=limits[panel.kind][0],
            vmax=limits[panel.kind][1], aspect="auto", interpolation="nearest"))
        start, end = panel.answer
        ax.add_patch(Rectangle((start - 0.5, -0.5), end - start, layers, fill=False, edgecolor="lime", linewidth=2))
        ax.axvline(panel.question - 0.5, color="0.6", linestyle="--", linewidth=1)
        ax.set_yticks(range(layers))
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=10, loc="left")
    for kind, kind_images in images.items():
        label = "A1 - lambda A2 weight" if kind == "differential" else "attention weight"
        fig.colorbar(kind_images[0], ax=[image.axes for image in kind_images], label=label, shrink=0.9)
    axes[-1, 0].set_xlabel("key position (outlined: the answer needle; right of the dashed line: the question, "
                           "not counted as noise)")
    fig.suptitle("Attention of the answering position per layer, heads averaged", fontsize=11)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return fig


def attention_noise_reports(models: dict[str, tuple], length: int, needles: int, seed: int) -> dict[str, dict]:
    """{name: (eager model, tokenizer)}, the first one DIFF -> {name: `attention_noise` report}, on one prompt built
    with the first model's tokenizer."""
    settings = NeedleSettings(needles=needles, queries=1)
    prompt = build_needle_prompt(next(iter(models.values()))[1], length, 50, settings, random.Random(seed))
    return {name: attention_noise(model, tokenizer, prompt) for name, (model, tokenizer) in models.items()}


def attention_logits(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
    """q k^T * scaling of one attention module [B, heads (both branches for DIFF), T, T], recomputed from its input."""
    if isinstance(module, DiffAttention):
        q, k, _ = module.project(hidden, position_embeddings)
        _, _, k1, k2 = split_branches(q, k)
        k = torch.cat([k1, k2], dim=1)  # [B, 2h_kv, T, d] in branch order, matching q's "halves"
    else:
        shape = (*hidden.shape[:2], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    return torch.matmul(q.float(), k.float().transpose(2, 3)) * module.scaling


def exact_median(values: torch.Tensor) -> float:
    """The median of every entry of `values`, as numpy defines it: the middle entry in sorted order, or for an even
    count the mean of the two middle entries (torch's `median` takes the lower one); computed in float64."""
    ordered = values.flatten().double().sort().values
    count = ordered.numel()
    check(count > 0, "the median of no values is undefined")
    return ((ordered[(count - 1) // 2] + ordered[count // 2]) / 2).item()


def magnitude_stats(values: list[torch.Tensor], top_k: int) -> dict:
    """Top-k of |x| and the exact median of |x| (`exact_median`) over every entry of all chunks together, and
    top-1 / median."""
    magnitudes = torch.cat([v.abs().flatten() for v in values])
    tops = magnitudes.topk(min(top_k, magnitudes.numel())).values
    median = exact_median(magnitudes)
    return {"top": tops.tolist(), "median": median, "ratio": tops[0].item() / median}


def activation_tensors(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer the attention logits [B, heads (DIFF: branch 1's, then branch 2's), T, T], recomputed from each
    attention's input by a forward pre-hook, and each decoder layer's output [B, T, hidden] (the residual stream after
    the layer, as the paper's Table 5 measures it), read by a forward hook. Not `output_hidden_states`: its last entry
    is the final norm's output, which replaces the last layer's."""
    logits: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []

    def attention_hook(module, args, kwargs):
        states = kwargs["hidden_states"]  # Llama's decoder layer passes it by name
        logits.append(attention_logits(module, states, kwargs["position_embeddings"]))

    def layer_hook(module, args, output):
        hidden.append(output[0] if isinstance(output, tuple) else output)

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(attention_hook, with_kwargs=True) for layer in layers]
    handles += [layer.register_forward_hook(layer_hook) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids.to(model.device))
    finally:
        for handle in handles:
            handle.remove()
    return logits, hidden


def causal_entries(scores: torch.Tensor) -> torch.Tensor:
    """The entries [..., T (T + 1) / 2] of scores [..., T, T] that causal attention reads."""
    return scores[..., torch.ones(scores.shape[-2:], dtype=torch.bool).tril()]


def branches(module: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(branch 1, branch 2) of one layer's attention logits [B, heads, ...] when the layer is differential with the
    branches as head halves (ours: q rows [branch 1 | branch 2]; transformers' DiffLlama: heads [:h] and [h:]);
    None otherwise (softmax layers, DIFF V2's interleaved head pairs)."""
    if isinstance(module, DiffAttention) or type(module).__name__.startswith("DiffLlama"):
        return logits.chunk(2, dim=1)
    return None


def activation_outliers(model, input_ids: torch.Tensor, top_k: int = 3) -> dict:
    """Table 5: attention logits (causal entries, per layer; both branches pooled, as the paper's Table 5 has one
    figure per model) and hidden states (every decoder layer's output); for differential layers also each branch alone
    ("attention_logits, branch 1" / "branch 2")."""
    check(top_k >= 1, f"top_k must be at least 1, got {top_k}")
    check(input_ids.shape[-1] >= 1, "input_ids is empty: give at least one token")
    logits, hidden = activation_tensors(model, input_ids)
    report = {"attention_logits": magnitude_stats([causal_entries(s) for s in logits], top_k)}
    split = [pair for layer, s in zip(model.model.layers, logits) if (pair := branches(layer.self_attn, s))]
    for b in (0, 1) if split else ():
        report[f"attention_logits, branch {b + 1}"] = magnitude_stats([causal_entries(p[b]) for p in split], top_k)
    return {**report, "hidden_states": magnitude_stats(hidden, top_k)}


def outlier_table(reports: dict[str, dict]) -> str:
    k = len(next(iter(reports.values()))["hidden_states"]["top"])
    header = "| model | activation | " + " | ".join(f"top-{i + 1}" for i in range(k)) + " | median | top-1 / median |"
    lines = [header, "|" + "---|" * (k + 4)]
    for name, report in reports.items():
        for kind, stats in report.items():
            tops = " | ".join(f"{v:.2f}" for v in stats["top"])
            lines.append(f"| {name} | {kind} | {tops} | {stats['median']:.3f} | {stats['ratio']:.1f} |")
    return "\n".join(lines)


def outlier_reports(models: dict[str, tuple], length: int, top_k: int, seed: int) -> dict[str, dict]:
    """{name: (model, tokenizer)} -> {name: `activation_outliers` report} on the same filler text, `length` tokens
    of it per model."""
    # twice the length: enough text for `length` tokens with the first model's tokenizer and a coarser baseline's
    text = " ".join(filler_sentences(next(iter(models.values()))[1], 2 * length, random.Random(seed)))
    # the text is tokenized whole, past the context, and cut: the tokenizer's length warning does not apply
    ids = {name: tokenizer(text, return_tensors="pt", verbose=False)["input_ids"][:, :length]
           for name, (_, tokenizer) in models.items()}
    return {name: activation_outliers(model, ids[name], top_k) for name, (model, _) in models.items()}


__all__ = [
    "NeedleSettings", "build_needle_prompt", "needle_accuracy", "accuracy_table", "allocation", "attention_noise",
    "activation_outliers", "activation_tensors", "exact_median", "magnitude_stats", "threshold_sweep", "noise_table",
    "outlier_table", "needle_table", "attention_noise_reports", "outlier_reports", "needle_grid", "save_heatmap",
    "noise_heatmaps", "save_noise_plot",
]
