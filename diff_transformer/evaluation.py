"""Evaluations of the Differential Transformer paper (Ye et al., arXiv 2410.05258) for any causal LM + tokenizer.

- Multi-needle retrieval (§3.4, Fig. 5): N needles "The magic number of <city> is <number>." in filler text, R of
  them queried, the queried needles placed at a given depth; greedy accuracy per (context length, depth).
- Attention noise (Table 3): the attention the answering (last) position gives to the answer needle versus to the
  rest of the context, per layer and averaged over heads and layers. For differential layers the map is
  A1 - lambda A2 (what multiplies V), so values may be negative; for softmax layers each row sums to 1.
- Activation outliers (Table 5): top-k magnitudes of attention logits (q k^T / sqrt(d), causal entries) and of
  hidden states against their median.
"""

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from .modeling_diff import DiffAttention, capture_branch_attentions, split_branches

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


@dataclass
class NeedlePrompt:
    context: str
    answers: list[tuple[str, str]]  # (city, number) of the queried needles
    spans: list[tuple[int, int]]  # character span of each queried needle in `context`

    def question(self, index: int) -> str:
        city = self.answers[index][0]
        return f"{self.context} What is the magic number of {city}? The magic number of {city} is"


def needle(city: str, number: str) -> str:
    return f"The magic number of {city} is {number}."


def filler_sentences(tokenizer: PreTrainedTokenizerBase, length: int, rng: random.Random) -> list[str]:
    """Random filler sentences totalling about `length` tokens."""
    sentences, total = [], 0
    while total < length:
        sentence = rng.choice(FILLER)
        sentences.append(sentence)
        total += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
    return sentences


def build_needle_prompt(
    tokenizer: PreTrainedTokenizerBase, length: int, depth: float, settings: NeedleSettings, rng: random.Random
) -> NeedlePrompt:
    """Filler of ~`length` tokens with N needles; the R queried ones sit together at `depth` percent."""
    cities = rng.sample(CITIES, settings.needles)
    numbers = [str(rng.randrange(10 ** (settings.digits - 1), 10**settings.digits)) for _ in cities]
    sentences = filler_sentences(tokenizer, length, rng)
    for city, number in zip(cities[settings.queries :], numbers[settings.queries :]):
        sentences.insert(rng.randrange(len(sentences) + 1), needle(city, number))
    at = round(depth / 100 * len(sentences))
    sentences[at:at] = [needle(c, n) for c, n in zip(cities[: settings.queries], numbers[: settings.queries])]
    context = " ".join(sentences)
    answers = list(zip(cities[: settings.queries], numbers[: settings.queries]))
    spans = [(context.index(needle(c, n)), context.index(needle(c, n)) + len(needle(c, n))) for c, n in answers]
    return NeedlePrompt(context, answers, spans)


def answer_correct(model, tokenizer: PreTrainedTokenizerBase, prompt: str, number: str) -> bool:
    """Greedy continuation starts with the number."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    steps = len(tokenizer(" " + number, add_special_tokens=False)["input_ids"]) + 1
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip().startswith(number)


def needle_accuracy(model, tokenizer: PreTrainedTokenizerBase, settings: NeedleSettings) -> dict:
    """{(length, depth): share of queried needles answered correctly} over `samples` seeded prompts each."""
    results = {}
    for length in settings.lengths:
        for depth in settings.depths:
            rng = random.Random(f"{settings.seed}-{length}-{depth}")
            prompts = [build_needle_prompt(tokenizer, length, depth, settings, rng) for _ in range(settings.samples)]
            hits = [answer_correct(model, tokenizer, p.question(i), p.answers[i][1])
                    for p in prompts for i in range(settings.queries)]
            results[(length, depth)] = sum(hits) / len(hits)
    return results


def accuracy_table(results: dict, settings: NeedleSettings) -> str:
    """Markdown: one row per context length, one column per depth."""
    header = "| length \\ depth | " + " | ".join(f"{d:g}%" for d in settings.depths) + " | mean |"
    lines = [header, "|" + "---|" * (len(settings.depths) + 2)]
    for length in settings.lengths:
        row = [results[(length, d)] for d in settings.depths]
        lines.append(f"| {length} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {sum(row) / len(row):.2f} |")
    return "\n".join(lines)


def save_heatmap(results: dict, settings: NeedleSettings, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[results[(length, d)] for d in settings.depths] for length in settings.lengths]
    fig, ax = plt.subplots(figsize=(1.2 * len(settings.depths) + 2, 0.6 * len(settings.lengths) + 2))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(settings.depths)), [f"{d:g}%" for d in settings.depths])
    ax.set_yticks(range(len(settings.lengths)), [str(n) for n in settings.lengths])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center")
    ax.set(xlabel="answer depth", ylabel="context length (tokens)", title=title)
    fig.colorbar(image, ax=ax)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def load(model_dir: str, attn_implementation: str = "sdpa"):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn_implementation).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def run_needle_cli(model_dir: str, settings: NeedleSettings, output: str) -> str:
    """Print and write PREFIX.md (table) and PREFIX.png (heatmap); return the table."""
    model, tokenizer = load(model_dir)
    results = needle_accuracy(model, tokenizer, settings)
    title = f"multi-needle N={settings.needles} R={settings.queries}: {Path(model_dir).name}"
    table = f"{title}\n\n{accuracy_table(results, settings)}\n"
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{output}.md").write_text(table)
    save_heatmap(results, settings, f"{output}.png", title)
    print(table)
    return table


def span_positions(tokenizer: PreTrainedTokenizerBase, text: str, prompt: NeedlePrompt) -> dict[str, torch.Tensor]:
    """Token ids, and the positions of the answer needle and of the rest of the context."""
    encoded = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded["offset_mapping"][0]
    start, end = prompt.spans[0]
    real = offsets[:, 1] > offsets[:, 0]  # special tokens have empty offsets
    answer = real & (offsets[:, 0] < end) & (offsets[:, 1] > start)
    context = real & (offsets[:, 1] <= len(prompt.context))
    return {"input_ids": encoded["input_ids"], "answer": answer, "noise": context & ~answer}


def last_row_maps(model, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[tuple]]:
    """Head-averaged attention of the last position per layer [S], and (A1, lambda A2) rows of differential layers."""
    with torch.no_grad(), capture_branch_attentions(model) as branches:
        maps = model(input_ids.to(model.device), output_attentions=True).attentions
        rows = [m[0, :, -1].float().mean(0).cpu() for m in maps]
        branch_rows = [(a1[0, :, -1].mean(0).cpu(), (lam * a2[0, :, -1]).mean(0).cpu()) for a1, a2, lam in branches]
    return rows, branch_rows


def attention_noise(model, tokenizer: PreTrainedTokenizerBase, prompt: NeedlePrompt) -> dict:
    """Answer share and noise (attention to the rest of the context) per layer and their means (eager models)."""
    positions = span_positions(tokenizer, prompt.question(0), prompt)
    rows, branch_rows = last_row_maps(model, positions["input_ids"])
    answer = [row[positions["answer"]].sum().item() for row in rows]
    noise = [row[positions["noise"]].sum().item() for row in rows]
    return {
        "answer": answer, "noise": noise, "mean_answer": sum(answer) / len(answer),
        "mean_noise": sum(noise) / len(noise), "rows": rows, "branch_rows": branch_rows, "positions": positions,
    }


def noise_table(reports: dict[str, dict]) -> str:
    """Markdown: per layer answer/noise for each model, then the mean."""
    names = list(reports)
    layers = max(len(r["answer"]) for r in reports.values())
    header = "| layer | " + " | ".join(f"{n} answer | {n} noise" for n in names) + " |"
    lines = [header, "|" + "---|" * (1 + 2 * len(names))]
    for i in range(layers):
        cells = [f"{r['answer'][i]:.3f} | {r['noise'][i]:.3f}" if i < len(r["answer"]) else "- | -"
                 for r in reports.values()]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    means = [f"**{r['mean_answer']:.3f}** | **{r['mean_noise']:.3f}**" for r in reports.values()]
    lines.append("| mean | " + " | ".join(means) + " |")
    return "\n".join(lines)


def save_noise_plot(reports: dict[str, dict], path: str | Path) -> None:
    """Layer-averaged attention of the answering position over the prompt: DIFF A1, lambda A2, A1 - lambda A2,
    and each other model's map; the answer needle is shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = []
    for name, report in reports.items():
        if report["branch_rows"]:
            curves.append((f"{name}: A1", torch.stack([b[0] for b in report["branch_rows"]]).mean(0), report))
            curves.append((f"{name}: lambda A2", torch.stack([b[1] for b in report["branch_rows"]]).mean(0), report))
        curves.append((f"{name}: attention map", torch.stack(report["rows"]).mean(0), report))
    fig, axes = plt.subplots(len(curves), 1, figsize=(10, 1.8 * len(curves)), sharex=True, squeeze=False)
    for ax, (label, curve, report) in zip(axes[:, 0], curves):
        ax.plot(curve.numpy(), linewidth=0.8)
        answer = report["positions"]["answer"].nonzero().flatten()
        ax.axvspan(answer.min().item(), answer.max().item() + 1, color="orange", alpha=0.3)
        ax.set_title(label, fontsize=9)
    axes[-1, 0].set_xlabel("key position (orange: answer needle)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_attention_noise_cli(
    model_dir: str, baseline_dir: str | None, length: int, needles: int, seed: int, output: str
) -> str:
    """Same prompt (model's tokenizer) for the model and the baseline; write PREFIX.md and PREFIX.png."""
    models = {"diff": load(model_dir, "eager")}
    if baseline_dir is not None:
        models["baseline"] = load(baseline_dir, "eager")
    settings = NeedleSettings(needles=needles, queries=1)
    prompt = build_needle_prompt(models["diff"][1], length, 50, settings, random.Random(seed))
    reports = {name: attention_noise(model, tokenizer, prompt) for name, (model, tokenizer) in models.items()}
    table = noise_table(reports)
    Path(f"{output}.md").write_text(table + "\n")
    save_noise_plot(reports, f"{output}.png")
    print(table)
    return table


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


def magnitude_stats(values: list[torch.Tensor], top_k: int) -> dict:
    """Top-k of |x| over all chunks and the median of the per-chunk medians (exact for one chunk)."""
    tops = torch.cat([v.abs().flatten().topk(min(top_k, v.numel())).values for v in values]).topk(top_k).values
    median = torch.stack([v.abs().flatten().median() for v in values]).median()
    return {"top": tops.tolist(), "median": median.item(), "ratio": (tops[0] / median).item()}


def activation_outliers(model, input_ids: torch.Tensor, top_k: int = 3) -> dict:
    """Table 5: attention logits (causal entries, per layer) and hidden states (every layer output)."""
    logits: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        scores = attention_logits(module, hidden, kwargs["position_embeddings"])
        logits.append(scores[..., torch.ones(scores.shape[-2:], dtype=torch.bool).tril()])

    modules = [layer.self_attn for layer in model.model.layers]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            hidden = model(input_ids.to(model.device), output_hidden_states=True).hidden_states[1:]
    finally:
        for handle in handles:
            handle.remove()
    return {"attention_logits": magnitude_stats(logits, top_k), "hidden_states": magnitude_stats(list(hidden), top_k)}


def outlier_table(reports: dict[str, dict]) -> str:
    k = len(next(iter(reports.values()))["hidden_states"]["top"])
    header = "| model | activation | " + " | ".join(f"top-{i + 1}" for i in range(k)) + " | median | top-1 / median |"
    lines = [header, "|" + "---|" * (k + 4)]
    for name, report in reports.items():
        for kind, stats in report.items():
            tops = " | ".join(f"{v:.2f}" for v in stats["top"])
            lines.append(f"| {name} | {kind} | {tops} | {stats['median']:.3f} | {stats['ratio']:.1f} |")
    return "\n".join(lines)


def run_outliers_cli(model_dir: str, baseline_dir: str | None, length: int, top_k: int, seed: int) -> str:
    models = {"diff": load(model_dir)}
    if baseline_dir is not None:
        models["baseline"] = load(baseline_dir)
    text = " ".join(filler_sentences(models["diff"][1], length, random.Random(seed)))
    reports = {}
    for name, (model, tokenizer) in models.items():
        ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length]
        reports[name] = activation_outliers(model, ids, top_k)
    table = outlier_table(reports)
    print(table)
    return table


__all__ = [
    "NeedleSettings", "build_needle_prompt", "needle_accuracy", "accuracy_table", "attention_noise",
    "activation_outliers", "noise_table", "outlier_table",
]
