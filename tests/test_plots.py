"""The PNGs of `eval-needle` and `attention-noise`: each draws exactly the arrays its pure function returns
(`needle_grid`, `noise_heatmaps`), read back from the Figure and compared with values computed here; the data
aggregated as the tables aggregate gives the written tables' numbers; the file is a PNG of figsize x dpi pixels; and
the committed example image's run (docs/images) recomputes to the committed table."""

import re
import shlex
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import printed_differences, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffForCausalLM, capture_branch_attentions
from diff_transformer.tools.commands import load_models
from diff_transformer.tools.evaluation import (
    CITIES,
    FILLER,
    PLOT_DPI,
    NeedleSettings,
    accuracy_table,
    attention_noise_reports,
    needle,
    needle_grid,
    noise_heatmaps,
    noise_table,
    save_heatmap,
    save_noise_plot,
)
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer_cli import build_parser

pytest.importorskip("matplotlib")

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs" / "evaluation.md"
EXAMPLE = ROOT / "docs" / "images" / "attention_noise"  # the committed example: .md and .png
PRINTED = 5e-4 + 1e-6  # the tables print 3 decimals
# The evaluation commands measure in float32 (bf16 sums moved by up to 0.1 between CPUs where a row sum is small), so a
# recomputation on another CPU differs from the committed table by fp32 rounding (~1e-6) besides its printed decimals;
# a table printed on either side of a rounding boundary differs by one unit of its last digit (`printed_differences`).
CROSS_CPU = 1e-5
ATOL = 1e-6  # fp32 head means, compared with the same maps read directly


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def check_png(path: Path, fig) -> None:
    """The file is the figure at PLOT_DPI, uncropped: figsize x dpi pixels."""
    width, height = fig.get_size_inches() * PLOT_DPI
    assert png_size(path) == (round(width), round(height)), (png_size(path), width, height)


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table of `text` as rows of {header: cell}."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif block:
            tables.append([dict(zip(block[0], row)) for row in block[2:]])
            block = []
    return tables


def panels_by_title(fig) -> dict[str, object]:
    """{title: axes} of the figure's heatmap panels (the colour bars have no title)."""
    return {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_title(loc="left")}


# --- needle: accuracy by length and depth ---


def test_needle_heatmap_draws_the_table(tmp_path):
    """Three lengths x four depths with a distinct accuracy per cell: the image's cell [i, j] is length i at depth j
    (a transposed grid fails on shape and values), each printed value and the row means are the table's."""
    settings = NeedleSettings(lengths=[96, 128, 256], depths=[0, 25, 50, 100])
    results = {(n, d): (3 * i + j + 1) / 16 for i, n in enumerate(settings.lengths)
               for j, d in enumerate(settings.depths)}
    path = tmp_path / "needle.png"
    fig = save_heatmap(results, settings, path, "title")
    check_png(path, fig)
    assert png_size(path) == (round((1.2 * 4 + 2) * PLOT_DPI), round((0.6 * 3 + 2) * PLOT_DPI))
    ax = fig.axes[0]
    drawn = np.asarray(ax.images[0].get_array())
    expected = np.array([[results[(n, d)] for d in settings.depths] for n in settings.lengths])
    assert drawn.shape == (3, 4) and np.array_equal(drawn, expected), drawn
    assert np.array_equal(needle_grid(results, settings), drawn), "the writer draws needle_grid's array"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["96", "128", "256"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0%", "25%", "50%", "100%"]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts}
    table = markdown_tables(accuracy_table(results, settings))[0]
    for i, row in enumerate(table):
        assert row["length \\ depth"] == str(settings.lengths[i])
        for j, depth in enumerate(settings.depths):
            assert texts[(i, j)] == row[f"{depth:g}%"], (i, j, texts[(i, j)], row)
        assert f"{drawn[i].mean():.2f}" == row["mean"], "the table's mean per length is the image row's mean"


# --- attention noise: differential map, branches, softmax map ---


@pytest.fixture(scope="module")
def reports():
    """attention_noise reports of a tiny DIFF and Llama on one 100-token prompt (3 needles), and the models."""
    texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 3
    tokenizer = train_bpe_tokenizer(texts=texts + [f"What is the magic number of {c}?" for c in CITIES],
                                    vocab_size=400)
    torch.manual_seed(0)
    diff = DiffForCausalLM._from_config(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512),
                                        attn_implementation="eager").eval()
    llama = LlamaForCausalLM._from_config(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=512), attn_implementation="eager").eval()
    models = {"diff": (diff, tokenizer), "llama": (llama, tokenizer)}
    return attention_noise_reports(models, 100, 3, 0), models


def read_back(fig) -> dict[str, np.ndarray]:
    return {title: np.asarray(ax.images[0].get_array(), dtype=float) for title, ax in panels_by_title(fig).items()}


def check_aggregates(maps: dict[str, np.ndarray], reports: dict[str, dict], table: str,
                     tolerance: float = PRINTED, normalised: bool = True) -> None:
    """The map panels summed as the table sums them: per layer the row sum, the weight on the answer (raw) and on
    the noise; the means over layers and the share; with `normalised` (fp32 models, whose heads of one layer share
    one row sum, 1 - lambda, so head-averaged rows divide as each head's do) the normalised figures where |row sum|
    >= 0.1. Each equals the written table's figure to its printed digits (within `tolerance`)."""
    overall, per_layer = markdown_tables(table)[:2]
    titles = {"diff": "diff: A1 - lambda A2 (differential map)"}
    for row in overall:
        name = row["model"]
        values = maps[titles.get(name, f"{name}: softmax map")]
        answer, noise = (reports[name]["positions"][k].numpy() for k in ("answer", "noise"))
        sums, answers, noises = values.sum(1), values[:, answer].sum(1), values[:, noise].sum(1)
        kept = np.abs(sums) >= 0.1
        normalized_answer, normalized_noise = answers / sums, noises / sums
        for i, layer in enumerate(per_layer):
            for column, value in [("row sum", sums[i]), ("answer, raw", answers[i]), ("noise, raw", noises[i]),
                                  ("answer, normalised", normalized_answer[i]),
                                  ("noise, normalised", normalized_noise[i])]:
                cell = layer[f"{name} {column}"]
                if "normalised" in column and not normalised:
                    continue
                if "normalised" in column and not kept[i]:
                    assert cell == "excluded", (name, i, column, cell)
                else:
                    assert abs(float(cell) - value) <= tolerance, (name, i, column, cell, value)
        mean_answer, mean_noise = answers.mean(), noises.mean()
        for column, value in [("answer, raw", mean_answer), ("noise, raw", mean_noise),
                              ("share", mean_answer / (mean_answer + mean_noise)),
                              *([("answer, normalised", normalized_answer[kept].mean()),
                                 ("noise, normalised", normalized_noise[kept].mean())] if normalised else [])]:
            assert abs(float(row[column]) - value) <= tolerance, (name, column, row[column], value)


def test_noise_heatmaps_draw_the_branches_and_maps(reports, tmp_path):
    """Panels read back from the Figure against maps read here: DIFF's A1 and lambda A2 from
    `capture_branch_attentions` (A1's rows sum to 1, lambda A2's to the layer's lambda, so branches swapped or
    lambda dropped fail), their difference the differential map that `output_attentions` returns (rows sum to
    1 - lambda); Llama's softmax map; layers down, key positions across; the answer needle outlined on every panel;
    one colour scale per panel kind."""
    reports, models = reports
    path = tmp_path / "noise.png"
    fig = save_noise_plot(reports, path)
    check_png(path, fig)
    maps = read_back(fig)
    assert list(maps) == ["diff: A1 - lambda A2 (differential map)", "diff: A1 (branch 1)",
                          "diff: lambda A2 (branch 2)", "llama: softmax map"]
    assert {t: p.values.tolist() for t, p in noise_heatmaps(reports).items()} == {
        t: v.tolist() for t, v in maps.items()}, "the writer draws noise_heatmaps' arrays"
    ids = reports["diff"]["positions"]["input_ids"]
    diff, llama = models["diff"][0], models["llama"][0]
    with torch.no_grad(), capture_branch_attentions(diff) as branches:
        diff_maps = diff(ids, output_attentions=True).attentions
    with torch.no_grad():
        llama_maps = llama(ids, output_attentions=True).attentions
    lambdas = np.array([layer.self_attn.lambda_params().item() for layer in diff.model.layers])
    expected = {
        "diff: A1 (branch 1)": np.stack([a1[0, :, -1].mean(0).numpy() for a1, _, _ in branches]),
        "diff: lambda A2 (branch 2)": np.stack([(lam * a2)[0, :, -1].mean(0).numpy() for _, a2, lam in branches]),
        "diff: A1 - lambda A2 (differential map)": np.stack([m[0, :, -1].mean(0).numpy() for m in diff_maps]),
        "llama: softmax map": np.stack([m[0, :, -1].mean(0).numpy() for m in llama_maps]),
    }
    keys = ids.shape[1]
    for title, values in expected.items():
        assert maps[title].shape == (len(values), keys), (title, maps[title].shape)
        gap = np.abs(maps[title] - values)
        assert gap.max() <= ATOL, f"{title}: max abs diff {gap.max():.2e}, mean {gap.mean():.2e}"
    assert np.allclose(maps["diff: A1 (branch 1)"].sum(1), 1, atol=ATOL), "softmax rows of branch 1 sum to 1"
    assert np.allclose(maps["diff: lambda A2 (branch 2)"].sum(1), lambdas, atol=ATOL), "branch 2 sums to lambda"
    assert np.abs(lambdas - 1).min() > 0.1, "lambda far from 1: A2 without lambda would be told apart"
    difference = maps["diff: A1 (branch 1)"] - maps["diff: lambda A2 (branch 2)"]
    assert np.abs(difference - maps["diff: A1 - lambda A2 (differential map)"]).max() <= ATOL

    answer = reports["diff"]["positions"]["answer"].nonzero().flatten()
    span = (answer.min().item() - 0.5, answer.max().item() + 0.5)
    assert len(answer) == span[1] - span[0], "the needle's tokens are contiguous"
    for title, ax in panels_by_title(fig).items():
        (x0, _), (x1, _) = ax.patches[0].get_bbox().get_points()
        assert (x0, x1) == span, f"{title}: outline over keys {x0}..{x1}, answer {span}"
    limits = {title: ax.images[0].get_clim() for title, ax in panels_by_title(fig).items()}
    weights = [v for t, v in limits.items() if "differential" not in t]
    top = max(maps[t].max() for t in maps if "differential" not in t)
    assert weights == [(0.0, pytest.approx(top))] * 3, f"one scale for A1, lambda A2 and softmax maps: {limits}"
    signed = np.abs(maps["diff: A1 - lambda A2 (differential map)"]).max()
    assert limits["diff: A1 - lambda A2 (differential map)"] == (pytest.approx(-signed), pytest.approx(signed))


def test_noise_heatmaps_sum_to_the_written_table(reports, tmp_path):
    """The drawn differential and softmax maps, summed over the answer and noise keys, give the table's numbers."""
    reports, _ = reports
    fig = save_noise_plot(reports, tmp_path / "noise.png")
    check_aggregates(read_back(fig), reports, noise_table(reports))


def test_noise_plot_without_matplotlib(reports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert save_noise_plot(reports[0], tmp_path / "noise.png") is None and not (tmp_path / "noise.png").exists()


# --- the committed example image (docs/images/attention_noise.png) ---


def documented_command() -> str:
    """The command docs/evaluation.md gives for the example image (backslash continuations joined)."""
    text = DOCS.read_text().replace("\\\n", " ")
    found = re.findall(r"^diff-transformer attention-noise .*--output docs/images/attention_noise\s*$", text,
                       flags=re.M)
    assert len(found) == 1, "docs/evaluation.md gives the command that writes docs/images/attention_noise"
    return found[0]


def test_printed_differences_allow_one_unit_and_nothing_else():
    """The committed-table comparison: a figure one unit of its last digit apart passes (a rounding boundary on
    another CPU), two units, a changed word, a changed integer or a lost line do not."""
    committed = "| DIFF | 0.040M | 4.158 | 3 heads |\nrun time 0.7 min"
    assert printed_differences(committed.replace("4.158", "4.157").replace("0.7", "0.8"), committed) == []
    for old, new in (("4.158", "4.156"), ("DIFF", "Llama"), ("3 heads", "2 heads")):
        assert len(printed_differences(committed.replace(old, new), committed)) == 1, new
    assert printed_differences(committed.splitlines()[0], committed) == ["1 lines vs 2 committed"]


def test_committed_example_recomputes_to_its_table(tmp_path):
    """The documented command's run, on the committed retrieval models, recomputed here: its table has the committed
    table's numbers and its heatmap data summed as the table sums give them (raw answer, noise, row sum per layer,
    their means and the share: the bf16 models' heads differ a little in row sum, so the normalised figures are not
    a division of head-averaged rows), to the printed digits and the bf16 models' drift between CPUs (`CROSS_CPU`);
    and the image's size is the committed image's."""
    args = build_parser().parse_args(shlex.split(documented_command())[1:])
    args.model, args.baseline = str(ROOT / args.model), str(ROOT / args.baseline)
    models = load_models(args, "eager")  # as the command loads them
    reports = attention_noise_reports(models, args.length, args.needles, args.seed)
    committed = (EXAMPLE.with_suffix(".md")).read_text()
    got = noise_table(reports)
    found = printed_differences(got, committed, slack=CROSS_CPU)
    assert not found, "recomputed table vs the committed one:\n" + "\n".join(found)
    fig = save_noise_plot(reports, tmp_path / "noise.png")
    check_aggregates(read_back(fig), reports, committed, tolerance=PRINTED + CROSS_CPU, normalised=False)
    assert png_size(tmp_path / "noise.png") == png_size(EXAMPLE.with_suffix(".png"))
    assert EXAMPLE.with_suffix(".png").stat().st_size < 150_000
    assert "](images/attention_noise.png)" in DOCS.read_text()
