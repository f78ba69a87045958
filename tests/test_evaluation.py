"""Evaluation: needle retrieval, attention noise and activation outliers, and the paper_small benchmark.

Needle retrieval, attention noise and activation outliers (paper §3.4, Tables 3 and 5) on tiny models, their settings'
checks and their tables without matplotlib; the paper_small benchmark's runs, quantization and reports."""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BENCHMARKS, load_benchmark, printed_differences, saved_folders, tiny_config
from helpers.cli import cli_process_env
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.llama import modeling_llama

from diff_transformer import DiffForCausalLM, capture_branch_attentions
from diff_transformer.tools.data import KeyValueTask
from diff_transformer.tools.evaluation import (
    CITIES,
    FILLER,
    NeedleSettings,
    activation_outliers,
    allocation,
    attention_maps,
    attention_noise,
    branches,
    build_needle_prompt,
    activation_tensors,
    causal_entries,
    exact_median,
    magnitude_stats,
    needle,
    threshold_sweep,
)
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer.tools.safe_write import TEST_KILL
from diff_transformer_cli import main

SHARE_ATOL = 1e-5  # fp32 sums of attention rows


@pytest.fixture(scope="module")
def tokenizer():
    texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 3
    texts += [f"What is the magic number of {c}?" for c in CITIES]
    return train_bpe_tokenizer(texts=texts, vocab_size=400)


def tiny_models(tokenizer):
    diff = DiffForCausalLM._from_config(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=512),
                                        attn_implementation="eager").eval()
    llama = LlamaForCausalLM._from_config(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=512), attn_implementation="eager").eval()
    return diff, llama


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_needle_prompt_places_needles(tokenizer, depth):
    settings = NeedleSettings(needles=5, queries=2)
    prompt = build_needle_prompt(tokenizer, 200, depth, settings, random.Random(0))
    assert prompt.context.count("The magic number of") == 5 and len(prompt.answers) == 2
    start, end = prompt.spans[0]
    assert prompt.context[start:end] == needle(*prompt.answers[0])
    assert abs(start / len(prompt.context) - depth / 100) < 0.15, f"needle at {start / len(prompt.context):.2f}"
    longest_filler = max(len(tokenizer(" " + s)["input_ids"]) for s in FILLER)
    tokens = max(len(tokenizer(prompt.question(i))["input_ids"]) for i in range(2))
    assert 200 - longest_filler - 2 <= tokens <= 200, f"question prompts have up to {tokens} tokens for 200"
    again = build_needle_prompt(tokenizer, 200, depth, settings, random.Random(0))
    assert again == prompt, "prompts must be reproducible from the seed"


def test_eval_needle_cli_writes_table_and_heatmap(tokenizer, tmp_path):
    diff, _ = tiny_models(tokenizer)
    diff.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "needle"
    main(["eval-needle", str(tmp_path / "model"), "--lengths", "96", "128", "--depths", "0", "50", "100",
          "--needles", "3", "--queries", "2", "--samples", "1", "--output", str(out)])
    table = (tmp_path / "needle.md").read_text()
    assert "| 96 |" in table and "| 128 |" in table and "50%" in table
    assert (tmp_path / "needle.png").stat().st_size > 1000


def test_allocation_on_a_hand_computed_map():
    """Normalised (per head divided by its row sum, then averaged over heads and layers), raw and share on a
    3-layer map worked out by hand; the layer whose row sums to 0.05 (lambda 0.95) is excluded and listed, not
    averaged in. Keys: 0 BOS, 1-2 answer, 3 noise, 4 the question."""
    answer = torch.tensor([False, True, True, False, False])
    noise = torch.tensor([False, False, False, True, False])
    a1, a2 = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1]), torch.tensor([0.2, 0.1, 0.1, 0.4, 0.2])
    rows = [
        torch.stack([a1 - 0.5 * a2, torch.tensor([0.1, 0.05, 0.05, 0.2, 0.1])]),  # lambda 0.5: rows sum to 0.5
        torch.tensor([[0.0, 0.02, 0.0, 0.03, 0.0], [0.01, 0.01, 0.01, 0.01, 0.01]]),  # lambda 0.95: sum 0.05
        torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]),  # softmax: sum 1
    ]
    got = allocation(rows, answer, noise, min_row_sum=0.1)
    # by hand: head answers 0.5, 0.1 | 0.02, 0.02 | 0.6, 0.4; noises 0.0, 0.2 | 0.03, 0.01 | 0.2, 0.2
    expected = {
        "answer": [0.3, 0.02, 0.5], "noise": [0.1, 0.02, 0.2], "row_sum": [0.5, 0.05, 1.0],
        "mean_answer": 1.64 / 6, "mean_noise": 0.64 / 6, "share": 1.64 / 2.28,
        # kept heads: 0.5/0.5, 0.1/0.5, 0.6/1, 0.4/1 and 0/0.5, 0.2/0.5, 0.2/1, 0.2/1
        "mean_normalized_answer": (1.0 + 0.2 + 0.6 + 0.4) / 4, "mean_normalized_noise": (0.0 + 0.4 + 0.2 + 0.2) / 4,
    }
    for key, value in expected.items():
        gap = (torch.tensor(got[key], dtype=torch.float64) - torch.tensor(value, dtype=torch.float64)).abs()
        assert gap.max() <= 1e-6, f"{key}: {got[key]} vs {value} (max abs diff {gap.max():.2e}, mean {gap.mean():.2e})"
    assert got["normalized_answer"][1] is None and got["normalized_noise"][1] is None
    assert abs(got["normalized_answer"][0] - 0.6) < 1e-6 and abs(got["normalized_noise"][2] - 0.2) < 1e-6
    assert [(layer, head) for layer, head, _ in got["excluded"]] == [(1, 0), (1, 1)]
    assert all(abs(total - 0.05) < 1e-6 for _, _, total in got["excluded"])
    everything = allocation(rows, answer, noise, min_row_sum=0.01)  # nothing excluded: layer 1 counts 0.4 / 0.4
    assert abs(everything["mean_normalized_answer"] - (2.2 + 0.8) / 6) < 1e-6 and not everything["excluded"]
    nothing = allocation(rows[1:2], answer, noise, min_row_sum=0.1)
    assert nothing["mean_normalized_answer"] is None and nothing["share"] == pytest.approx(0.04 / 0.08)


def test_threshold_sweep_on_a_hand_computed_map():
    """The normalised figures at the cut-offs 0 / 0.1 / 0.2 on |row sum|, worked out by hand on 3 layers of one head.
    Keys: 0 answer, 1 noise, 2 the question. Row sums -0.05 (lambda 1.05), 0.15 and 1: each cut-off leaves out one
    more layer; a cut-off above every row sum leaves none (None, "undefined")."""
    answer, noise = torch.tensor([True, False, False]), torch.tensor([False, True, False])
    rows = [torch.tensor([[0.02, -0.09, 0.02]]), torch.tensor([[0.06, 0.03, 0.06]]), torch.tensor([[0.2, 0.7, 0.1]])]
    # normalised per layer: answer -0.4, 0.4, 0.2; noise 1.8, 0.2, 0.7
    expected = {"0": ((-0.4 + 0.4 + 0.2) / 3, (1.8 + 0.2 + 0.7) / 3, []),
                "0.1": ((0.4 + 0.2) / 2, (0.2 + 0.7) / 2, [[0, 0]]),
                "0.2": (0.2, 0.7, [[0, 0], [1, 0]])}
    got = threshold_sweep(rows, answer, noise)
    assert list(got) == list(expected), "the reports' cut-offs: none, the one used (0.1), twice it"
    for cutoff, (normalized_answer, normalized_noise, excluded) in expected.items():
        assert got[cutoff]["answer"] == pytest.approx(normalized_answer, abs=1e-6), (cutoff, got[cutoff])
        assert got[cutoff]["noise"] == pytest.approx(normalized_noise, abs=1e-6), (cutoff, got[cutoff])
        assert got[cutoff]["excluded"] == excluded, (cutoff, got[cutoff])
    above = threshold_sweep(rows, answer, noise, thresholds=(1.5,))["1.5"]
    assert above == {"answer": None, "noise": None, "excluded": [[0, 0], [1, 0], [2, 0]]}


def test_exact_median_of_all_values_not_of_chunk_medians():
    """Chunks |x| = [1, 2, 3] and [4, 5, 6, 7, 100]: eight values, so the median is the mean of the two middle ones,
    (4 + 5) / 2 = 4.5 (numpy's definition). The per-chunk medians (2 and 6) would give 2 (torch's lower middle) or
    4 (their mean), torch's median of all values 4 (the lower middle)."""
    chunks = [torch.tensor([[1.0, -2.0, 3.0]]), torch.tensor([4.0, 5.0, -6.0, 7.0, 100.0])]
    stats = magnitude_stats(chunks, top_k=2)
    assert stats == {"top": [100.0, 7.0], "median": 4.5, "ratio": 100.0 / 4.5}
    assert exact_median(torch.tensor([3.0, 1.0, 2.0])) == 2.0, "an odd count: the middle value"
    assert exact_median(torch.tensor([0.5, 0.25])) == 0.375, "two values: their mean"


def test_outlier_ratio_pools_both_branches_on_a_hand_computed_map(tokenizer):
    """One differential layer, one head per branch, 2 tokens: causal logits [1, 2, 3] (branch 1) and [10, 0.5, 4]
    (branch 2). Pooled: top-1 10, median 2.5 (the mean of the middle two of 0.5 1 2 3 4 10), ratio 4; branch 1
    alone: 3 / 2; branch 2 alone: 10 / 4."""
    diff, llama = tiny_models(tokenizer)
    logits = torch.tensor([[[[1.0, 99.0], [2.0, 3.0]], [[10.0, 99.0], [0.5, 4.0]]]])  # [B, 2 heads, T, T]
    pooled = magnitude_stats([causal_entries(logits)], 1)
    split = branches(diff.model.layers[0].self_attn, logits)
    one, two = (magnitude_stats([causal_entries(b)], 1) for b in split)
    assert (pooled["top"], pooled["median"], pooled["ratio"]) == ([10.0], 2.5, 4.0)
    assert (one["ratio"], two["ratio"]) == (1.5, 2.5)
    assert branches(llama.model.layers[0].self_attn, logits) is None, "a softmax layer has no branches"
    ids = torch.randint(4, len(tokenizer), (1, 30))
    report = activation_outliers(diff, ids, top_k=1)
    tops = [report[k]["top"][0] for k in ("attention_logits, branch 1", "attention_logits, branch 2")]
    assert report["attention_logits"]["top"][0] == max(tops), f"pooled top-1 {report['attention_logits']} vs {tops}"
    assert set(activation_outliers(llama, ids, top_k=1)) == {"attention_logits", "hidden_states"}


def test_attention_noise_matches_direct_sums(tokenizer, tmp_path, capsys):
    diff, llama = tiny_models(tokenizer)
    prompt = build_needle_prompt(tokenizer, 120, 50, NeedleSettings(needles=3, queries=1), random.Random(1))
    for model in (diff, llama):
        report = attention_noise(model, tokenizer, prompt)
        positions = report["positions"]
        answer_text = tokenizer.decode(positions["input_ids"][0][positions["answer"]]).strip()
        assert answer_text == needle(*prompt.answers[0]), f"answer positions decode to {answer_text!r}"
        with torch.no_grad():
            maps = model(positions["input_ids"], output_attentions=True).attentions
        for i, layer_map in enumerate(maps):  # independent: sum the returned maps directly
            row = layer_map[0, :, -1].mean(0)
            expected_answer = row[positions["answer"]].sum().item()
            assert abs(report["answer"][i] - expected_answer) <= SHARE_ATOL, (
                f"layer {i} answer share: max abs diff {abs(report['answer'][i] - expected_answer):.3e}")
            attention = model.model.layers[i].self_attn
            scale = 1 - attention.lambda_params().item() if model is diff else 1.0  # the row sum, 1 - lambda
            assert abs(report["row_sum"][i] - scale) <= SHARE_ATOL, f"layer {i}: row sum {report['row_sum'][i]}"
            expected_normalized = expected_answer / scale
            assert abs(report["normalized_answer"][i] - expected_normalized) <= SHARE_ATOL / scale, (
                f"layer {i} normalised answer: {report['normalized_answer'][i]} vs {expected_normalized}")
        total = report["mean_answer"] + report["mean_noise"]
        assert abs(report["share"] - report["mean_answer"] / total) <= SHARE_ATOL
        assert positions["answer"].sum() >= 6 and positions["noise"].sum() > positions["answer"].sum()
    llama_report = attention_noise(llama, tokenizer, prompt)
    assert all(0 <= a + n <= 1 + SHARE_ATOL for a, n in zip(llama_report["answer"], llama_report["noise"]))
    diff_report = attention_noise(diff, tokenizer, prompt)
    assert len(diff_report["branch_rows"]) == 2, "both branches of every differential layer are reported"

    diff.save_pretrained(tmp_path / "diff")
    llama.save_pretrained(tmp_path / "llama")
    for folder in ("diff", "llama"):
        tokenizer.save_pretrained(tmp_path / folder)
    out = tmp_path / "noise"
    capsys.readouterr()
    main(["attention-noise", str(tmp_path / "diff"), "--baseline", str(tmp_path / "llama"), "--length", "100",
          "--needles", "3", "--output", str(out)])
    printed = capsys.readouterr().out
    header = "| model | answer, normalised | noise, normalised | answer, raw | noise, raw | share |"
    assert header in printed and printed.count("\n| diff | ") == 1 and "\n| baseline | " in printed, printed
    assert (tmp_path / "noise.md").read_text().strip() in printed, "the written table is the printed one"
    assert (tmp_path / "noise.png").stat().st_size > 1000


def layer_outputs_reference(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every decoder layer's output read without hooks on the layers: `output_hidden_states` holds the input of each
    layer after the first (the outputs of all layers but the last); the last layer's output is what enters the final
    norm (captured by a pre-hook on the norm). Also the final norm's output, `hidden_states[-1]`."""
    entering = []
    handle = model.model.norm.register_forward_pre_hook(lambda module, args: entering.append(args[0]))
    try:
        with torch.no_grad():
            states = model(ids, output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return [*states[1:-1], entering[0]], states[-1]


def test_hidden_states_are_every_decoder_layer_output(tokenizer):
    """activation_tensors' hidden states are the residual stream after each decoder layer (paper Table 5), one per
    layer, the last layer's included and the final norm's output not: on a tiny DIFF and Llama with 2 layers."""
    diff, llama = tiny_models(tokenizer)
    ids = torch.randint(4, len(tokenizer), (1, 12))
    for model in (diff, llama):
        _, hidden = activation_tensors(model, ids)
        expected, normed = layer_outputs_reference(model, ids)
        assert len(hidden) == model.config.num_hidden_layers == len(expected)
        for i, (got, want) in enumerate(zip(hidden, expected)):
            assert torch.equal(got, want), f"layer {i}: max abs diff {(got - want).abs().max():.3e}"
        assert not any(torch.allclose(h, normed) for h in hidden), "the final norm's output is not a layer's output"


def test_activation_outliers_against_direct_computation(tokenizer, tmp_path, capsys):
    diff, llama = tiny_models(tokenizer)
    ids = torch.randint(4, len(tokenizer), (1, 40))
    for model in (diff, llama):
        report = activation_outliers(model, ids, top_k=3)
        hidden = torch.stack(layer_outputs_reference(model, ids)[0])
        expected_top = hidden.abs().flatten().topk(3).values
        got_top = torch.tensor(report["hidden_states"]["top"])
        gap = (got_top - expected_top).abs()
        assert gap.max() <= SHARE_ATOL, f"hidden top-k: max abs diff {gap.max():.3e}, mean {gap.mean():.3e}"
        logits = report["attention_logits"]
        assert logits["top"][0] >= logits["top"][1] >= logits["top"][2] > logits["median"] > 0
    scores = attention_logit_reference(llama, ids)
    got = activation_outliers(llama, ids, top_k=1)["attention_logits"]["top"][0]
    assert abs(got - scores) <= 1e-4 * scores, f"top attention logit: |{got} - {scores}|"
    for name, model in (("diff", diff), ("llama", llama)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    main(["outliers", str(tmp_path / "diff"), "--baseline", str(tmp_path / "llama"), "--length", "60", "--top-k", "2"])
    report = capsys.readouterr().out
    assert "| diff | attention_logits |" in report and "| baseline | hidden_states |" in report


def attention_logit_reference(model: LlamaForCausalLM, ids: torch.Tensor) -> float:
    """Largest causal |q k^T * scaling|, read inside Llama's own eager attention function (no recomputation)."""
    captured = []
    original = modeling_llama.eager_attention_forward

    def spy(module, query, key, value, attention_mask, scaling, **kwargs):
        keys = modeling_llama.repeat_kv(key, module.num_key_value_groups)
        scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
        captured.append(scores[..., torch.ones(scores.shape[-2:], dtype=torch.bool).tril()].abs().max())
        return original(module, query, key, value, attention_mask, scaling, **kwargs)

    modeling_llama.eager_attention_forward = spy
    try:
        with torch.no_grad():
            model(ids)
    finally:
        modeling_llama.eager_attention_forward = original
    return max(captured).item()


def test_diffllama_differential_map_is_what_multiplies_v(tokenizer):
    """transformers' DiffLlama returns the softmax maps of all 2h heads; attention_maps pairs them into A1 - lambda A2
    per differential head. Independent check: that map times the head's values (kv heads i and i + h side by side)
    reproduces the input of DiffLlama's head norm, captured with a hook."""
    torch.manual_seed(0)
    config = DiffLlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256)
    model = DiffLlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    for layer in model.model.layers:  # lambda away from its init, so that a wrong lambda shows
        torch.nn.init.normal_(layer.self_attn.lambda_q1, std=0.3)
    values, normed = [], []
    for layer in model.model.layers:
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out: values.append(out))
        layer.self_attn.groupnorm.register_forward_pre_hook(lambda m, a: normed.append(a[0]))
    ids = tokenizer("The sky is blue. The magic number of Oslo is 1234. Here we go.", return_tensors="pt")["input_ids"]
    maps, branches = attention_maps(model, ids)
    assert len(branches) == 2 and maps[0].shape[1] == 2, "h = 2 differential heads per layer"
    for i, (diff_map, v, expected) in enumerate(zip(maps, values, normed)):
        v = v.view(1, ids.shape[1], 4, 16).transpose(1, 2)  # [B, kv heads, S, d]
        v = torch.cat([v[:, :2], v[:, 2:]], dim=-1)  # head i reads kv heads i and i + h: [B, h, S, 2d]
        actual = (diff_map @ v).transpose(1, 2)  # [B, T, h, 2d]
        diff = (actual - expected).abs()
        assert torch.allclose(actual, expected, atol=1e-5), (
            f"layer {i}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """diff: a DIFF model and its English BPE tokenizer, saved (helpers.saved_folders)."""
    return saved_folders(tmp_path_factory.mktemp("mistakes"), ("diff",))


def test_tables_without_matplotlib_and_progress(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    main(["eval-needle", str(folders / "diff"), "--lengths", "100", "--depths", "0", "50", "--needles", "2",
          "--queries", "1", "--samples", "2", "--output", str(tmp_path / "needle")])
    captured = capsys.readouterr()
    assert "| 100 | " in captured.out and "matplotlib is not installed, so no" in captured.out, captured.out
    assert "4/4" in captured.err, "eval-needle shows prompts done of the total"
    assert (tmp_path / "needle.md").is_file() and not (tmp_path / "needle.png").exists()


def test_needle_settings_and_prompts():
    for fields, message in [({"needles": 50}, f"needles must be between 1 and {len(CITIES)}"),
                            ({"needles": 2, "queries": 3}, "queries must be between 1 and needles"),
                            ({"samples": 0}, "samples and digits must be >= 1"), ({"lengths": [0]}, "lengths must be"),
                            ({"depths": [150]}, "depths are percentages")]:
        with pytest.raises(ValueError, match=message):
            NeedleSettings(**fields)
    with pytest.raises(ValueError, match="the tokenizer cannot encode the needle text"):
        build_needle_prompt(KeyValueTask().tokenizer(), 100, 50, NeedleSettings(), random.Random(0))


def test_attention_maps_need_eager(folders):
    model = DiffForCausalLM.from_pretrained(folders / "diff")  # sdpa
    with pytest.raises(ValueError, match='attn_implementation="eager"'):
        with capture_branch_attentions(model):
            pass
    settings = NeedleSettings(needles=2, queries=1)
    tokenizer = AutoTokenizer.from_pretrained(folders / "diff")
    prompt = build_needle_prompt(tokenizer, 100, 50, settings, random.Random(0))
    with pytest.raises(ValueError, match="attention_noise reads attention maps.*'sdpa'"):
        attention_noise(model, tokenizer, prompt)
    for top_k, ids, message in [(0, torch.ones(1, 5, dtype=torch.long), "top_k must be at least 1"),
                                (3, torch.ones(1, 0, dtype=torch.long), "input_ids is empty")]:
        with pytest.raises(ValueError, match=message):
            activation_outliers(model, ids, top_k)



def load_paper_small():
    return load_benchmark("paper_small")


def test_paper_small_stopped_run_resumes_to_the_same_result(tmp_path, monkeypatch):
    """A run stopped after its first evaluation resumes from the saved training state and ends with the curve
    (loss, accuracy) and attention figures of a run never stopped (exact: same ops in the same order on one thread);
    its run time counts the time spent before the stop."""
    benchmark = load_paper_small()
    args = benchmark.parse_args(["--quick", "--steps", "6", "--curve-points", "3", "--examples", "24",
                                 "--eval-samples", "1", "--output-dir", str(tmp_path / "out")])
    unit = ("retrieval", "DIFF", 0, args.steps, args)
    whole = benchmark.run_unit(unit)
    benchmark.partial_path(unit).unlink()  # what run_or_load does once it stored the run
    evaluate, calls = benchmark.evaluate, []

    def evaluate_until(stop: int):
        def counted(*a, **k):
            calls.append(1)
            if len(calls) == stop:
                raise KeyboardInterrupt
            return evaluate(*a, **k)
        return counted

    monkeypatch.setattr(benchmark, "evaluate", evaluate_until(stop=2))
    with pytest.raises(KeyboardInterrupt):
        benchmark.run_unit(unit)
    calls.clear()
    state = torch.load(benchmark.partial_path(unit), weights_only=True)
    torch.save({**state, "seconds": 1000.0}, benchmark.partial_path(unit))  # time spent before the stop
    monkeypatch.setattr(benchmark, "evaluate", evaluate_until(stop=0))
    resumed = benchmark.run_unit(unit)
    assert resumed["seconds"] > 1000.0, f"run time {resumed['seconds']:.1f}s leaves out the 1000s before the stop"
    # from its first evaluation: 2 along training, then 1 of the stored model (`measure`)
    assert len(calls) == 3, f"the resumed run evaluated {len(calls)} times; from its first evaluation: 2 + 1"
    assert resumed["curve"] == whole["curve"], f"{resumed['curve']} != {whole['curve']}"
    assert (resumed["answer"], resumed["noise"]) == (whole["answer"], whole["noise"])


# One stored run of paper_small in a child process: benchmarks/paper_small.py, then its arguments
ONE_RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("paper_small", sys.argv[1])
benchmark = importlib.util.module_from_spec(spec)
spec.loader.exec_module(benchmark)
args = benchmark.parse_args(sys.argv[2:])
benchmark.run_or_load([("retrieval", "DIFF", 0, args.steps, args)], 1)
"""
CHILD_TIMEOUT = 600  # seconds: a loaded 2-core machine takes a minute or more to import torch


def test_paper_small_run_killed_while_stored_resumes_to_the_same_result(tmp_path, monkeypatch):
    """A run killed (SIGKILL) while its finished row is written leaves no half-written row to block the next call:
    that call clears the killed writer's staging file, resumes from the run's last training state without training
    again, and stores the row of a run never stopped."""
    benchmark = load_paper_small()
    argv = ["--quick", "--steps", "4", "--curve-points", "2", "--examples", "24", "--eval-samples", "1"]
    args = benchmark.parse_args([*argv, "--output-dir", str(tmp_path / "out")])
    unit = ("retrieval", "DIFF", 0, args.steps, args)
    stored = benchmark.stored_path(unit)
    child = subprocess.run([sys.executable, "-c", ONE_RUN, str(BENCHMARKS / "paper_small.py"), *argv, "--output-dir",
                            str(tmp_path / "out")], env=cli_process_env(**{TEST_KILL: f"written:{stored.name}"}),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert child.returncode == -signal.SIGKILL, child.stdout[-2000:] + child.stderr[-3000:]
    staging = [p.name for p in stored.parent.iterdir() if p.name.startswith(f".{stored.name}.incomplete-")]
    assert not stored.exists() and len(staging) == 1, sorted(p.name for p in stored.parent.iterdir())
    assert benchmark.partial_path(unit).is_file(), "the run's last training state is kept"

    evaluate, calls = benchmark.evaluate, []
    monkeypatch.setattr(benchmark, "evaluate", lambda *a, **k: calls.append(1) or evaluate(*a, **k))
    [row] = benchmark.run_or_load([unit], 1)
    assert len(calls) == 1, f"{len(calls)} evaluations: the resumed run trained again (1: the stored model's)"
    assert sorted(p.name for p in stored.parent.iterdir()) == sorted([stored.name, benchmark.model_path(unit).name])
    whole = benchmark.run_unit(("retrieval", "DIFF", 0, args.steps, benchmark.parse_args(
        [*argv, "--output-dir", str(tmp_path / "whole")])))
    assert row["curve"] == whole["curve"], f"{row['curve']} != {whole['curve']}"
    assert (row["answer"], row["noise"], row["model_sha256"]) == (whole["answer"], whole["noise"],
                                                                  whole["model_sha256"])


def process_state(pid: int) -> str | None:
    """A process's state letter (Z: ended, not yet reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/*/stat: the field after the state)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers end with their parent on Linux only")
def test_paper_small_workers_end_with_a_stopped_study(tmp_path):
    """A benchmark stopped by SIGTERM (which skips the pool's own shutdown) takes its training workers with it: none
    trains on, racing a restarted call for the same run files."""
    argv = ["--quick", "--tasks", "retrieval", "--steps", "4000", "--curve-points", "2000", "--examples", "24",
            "--eval-samples", "1", "--jobs", "2", "--output-dir", str(tmp_path)]
    parent = subprocess.Popen([sys.executable, str(BENCHMARKS / "paper_small.py"), *argv], env=cli_process_env(),
                              cwd=BENCHMARKS.parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    workers = []
    try:
        training = set()  # (model, seed) of the workers' evaluation lines: both workers are training
        for line in parent.stdout:
            if line.startswith("  retrieval "):
                training.add(line.split(":")[0])
            if len(training) == 2:
                break
        assert len(training) == 2, f"the study ended before both workers trained: {training}"
        workers = [pid for pid in children(parent.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2, children(parent.pid)
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
        deadline = time.monotonic() + 60
        while any(process_state(pid) not in (None, "Z") for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(process_state(pid) in (None, "Z") for pid in workers), "a worker trains on without its study"
    finally:
        for pid in [parent.pid, *workers]:
            if process_state(pid) not in (None, "Z"):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_paper_small_benchmark_smoke(tmp_path, capsys):
    """benchmarks/paper_small.py --quick end to end at toy size: three models at equal parameters on identical data,
    report and figures written; a missing text file is skipped, not an error; stored runs are reused when seeds are
    added or another task's settings change."""
    benchmark = load_paper_small()
    argv = ["--quick", "--steps", "4", "--curve-points", "2", "--examples", "24", "--eval-samples", "1",
            "--data", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "out")]
    report = benchmark.main(argv)
    assert "skipping the text experiment" in capsys.readouterr().out
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ") and "M |" in line]
    assert [row[1].strip() for row in rows] == ["DIFF", "DiffLlama", "Transformer"]
    params = [float(row[2].strip().rstrip("M")) for row in rows]
    assert max(params) / min(params) - 1 < 0.01, f"parameter counts differ: {params}"
    results = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert all(len(r["curve"]) == 2 and 0 <= r["accuracy"] <= 1 for r in results)
    for name in ("accuracy.png", "attention_maps.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000
    stored = {run: run.stat().st_mtime_ns for run in (tmp_path / "out" / "runs").glob("*.pt")}
    assert len(stored) == 6, sorted(stored)
    report = benchmark.main(argv + ["--seeds", "0", "1", "2", "--text-steps", "5"])  # a text-only flag changes no run
    assert all(run.stat().st_mtime_ns == mtime for run, mtime in stored.items()), "a stored run was trained again"
    assert len(list((tmp_path / "out" / "runs").glob("*.pt"))) == 9 and "3 seed(s)" in report
    assert len(list((tmp_path / "out" / "runs").glob("*.model"))) == 9, "every run saves its model"


def test_paper_small_fake_quantize_known_values():
    """Symmetric per tensor: scale = max|x| / (2^(b-1) - 1), round, clamp, dequantize."""
    benchmark = load_paper_small()
    x = torch.tensor([-3.0, -1.2, 0.0, 0.4, 1.6, 3.0])
    three_bits = benchmark.fake_quantize(x, 3)  # 3 levels a side, scale 1
    expected = torch.tensor([-3.0, -1.0, 0.0, 0.0, 2.0, 3.0])
    gap = (three_bits - expected).abs()
    assert gap.max() == 0, f"3 bits: max abs diff {gap.max():.3e}, mean {gap.mean():.3e}: {three_bits.tolist()}"
    two_bits = benchmark.fake_quantize(x / 3, 2)  # 1 level a side, scale 1
    assert two_bits.tolist() == [-1.0, 0.0, 0.0, 0.0, 1.0, 1.0], two_bits.tolist()
    assert benchmark.fake_quantize(torch.zeros(4), 4).tolist() == [0.0] * 4
    fill = torch.finfo(torch.float32).min
    masked = torch.tensor([[0.4, fill], [-1.2, 3.0]])  # the scale comes from the visible entries only
    assert benchmark.quantize_visible(masked, 3).tolist() == [[0.0, fill], [-1.0, 3.0]]


def fitted_models(benchmark, ids: torch.Tensor) -> dict:
    """The benchmark's three models (seeded init), fitted for 40 AdamW steps to the batch `ids` so that attention
    is peaked and matters to the loss, as in a trained model; eager, in eval mode."""
    args = benchmark.parse_args(["--quick", "--hidden", "64", "--heads", "2"])
    torch.manual_seed(0)
    models = benchmark.build_models(300, args)
    for model in models.values():
        model.set_attn_implementation("eager")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(40):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
    return models


def test_paper_small_quantization_hooks_change_the_loss():
    """On eager DIFF, DiffLlama and Llama: the swapped-in attention (bits None) gives the original loss exactly;
    16 bits changes it by < 1e-3, 2 bits by more than 0.1; the original functions are back after the block."""
    benchmark = load_paper_small()
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    originals = (benchmark.attention_kernels.masked_scores, modeling_llama.eager_attention_forward)
    for name, model in fitted_models(benchmark, ids).items():
        def loss() -> float:
            with torch.no_grad():
                return model(ids, labels=ids).loss.item()

        base = loss()
        with benchmark.quantized_attention_logits(model, None):
            assert loss() == base, f"{name}: the swapped-in eager attention changes the loss by {loss() - base:.3e}"
        for kind, quantized in (("logits", benchmark.quantized_attention_logits),
                                ("activations", benchmark.quantized_activations)):
            with quantized(model, 16):
                fine = loss() - base
            with quantized(model, 2):
                coarse = loss() - base
            assert abs(fine) < 1e-3, f"{name} {kind} at 16 bits: loss changes by {fine:.3e}"
            assert abs(coarse) > 0.1, f"{name} {kind} at 2 bits: loss changes by only {coarse:.3e}"
        assert loss() == base, f"{name}: a quantization hook outlived its block"
    assert (benchmark.attention_kernels.masked_scores, modeling_llama.eager_attention_forward) == originals
    with pytest.raises(ValueError, match="needs eager attention"):
        model.set_attn_implementation("sdpa")
        with benchmark.quantized_attention_logits(model, 8):
            pass


def report_tables(report: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith(("|", "#"))]


def test_paper_small_from_saved_reproduces_the_tables(shakespeare, tmp_path):
    """--quick end to end with saved models: every run leaves a from_pretrained folder whose checksum is in the
    stored run; --from-saved recomputes every table (loss, accuracy, noise, outliers, quantization) from the folders
    exactly, without rewriting the stored runs; a changed or missing folder stops it with one line naming the run.
    The text task reads the first 60,000 characters of tiny Shakespeare (the `shakespeare` fixture)."""
    benchmark = load_paper_small()
    text = tmp_path / "text.txt"
    text.write_text(shakespeare.read_text()[:60000])
    out = tmp_path / "out"
    argv = ["--quick", "--steps", "4", "--text-steps", "4", "--long-steps", "0", "--seeds", "0", "1",
            "--curve-points", "2", "--examples", "24", "--eval-samples", "1", "--data", str(text),
            "--output-dir", str(out)]
    trained = benchmark.main(argv)
    tasks = ["retrieval", "text"]
    for task in tasks:
        assert f"### Fake quantization, {task}" in trained and f"### Activation outliers, {task}" in trained
        assert (out / f"outliers_quantization_{task}.png").stat().st_size > 1000
    stored = {run: run.read_bytes() for run in (out / "runs").glob("*.pt")}
    assert len(stored) == 6 * len(tasks), sorted(stored)
    for run in stored:
        row = torch.load(run, weights_only=True)
        folder = run.with_suffix(".model")
        assert row["model_sha256"] == benchmark.weights_sha256(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        expected = {"DIFF": "DiffForCausalLM", "DiffLlama": "DiffLlamaForCausalLM", "Transformer": "LlamaForCausalLM"}
        assert type(model).__name__ == expected[row["model"]]
    again = benchmark.main(argv + ["--from-saved"])
    assert report_tables(again) == report_tables(trained), "\n".join(
        f"{a}\n{b}" for a, b in zip(report_tables(again), report_tables(trained)) if a != b)
    assert all(run.read_bytes() == data for run, data in stored.items()), "--from-saved rewrote a stored run"

    run = sorted(stored)[0]
    weights = run.with_suffix(".model") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    with pytest.raises(benchmark.SavedRunError, match=f"{run.name}: .* another model; delete {run}") as error:
        benchmark.main(argv + ["--from-saved"])
    assert "\n" not in str(error.value)
    weights.unlink()
    with pytest.raises(benchmark.SavedRunError, match=f"{run.name}: its saved model .* is missing"):
        benchmark.main(argv + ["--from-saved"])


def test_paper_small_threshold_table_by_hand():
    """threshold_means averages each cut-off's normalised figures over the prompts where a head is kept and pools the
    heads left out; threshold_table shows mean ± sd over seeds, and "undefined" where a seed keeps no head."""
    benchmark = load_paper_small()
    prompts = [{"by_threshold": {"0": {"answer": -0.3, "noise": 0.5, "excluded": []},
                                 "0.2": {"answer": None, "noise": None, "excluded": [[0, 0], [1, 0]]}}},
               {"by_threshold": {"0": {"answer": 0.1, "noise": 0.3, "excluded": []},
                                 "0.2": {"answer": 0.4, "noise": 0.2, "excluded": [[0, 0]]}}}]
    means = benchmark.threshold_means(prompts)
    assert means["0"] == {"answer": pytest.approx(-0.1), "noise": pytest.approx(0.4), "excluded": []}
    assert means["0.2"] == {"answer": 0.4, "noise": 0.2, "excluded": [[0, 0], [1, 0]]}
    runs = [{"model": "DIFF", "seed": 0, "by_threshold": means},
            {"model": "DIFF", "seed": 1, "by_threshold": {"0": {"answer": 0.3, "noise": 0.6, "excluded": []},
                                                          "0.2": {"answer": None, "noise": None,
                                                                  "excluded": [[0, 0], [1, 0], [2, 0]]}}}]
    table = benchmark.threshold_table(runs)
    # seeds' answers at 0: -0.1 and 0.3, mean 0.1, sd 0.283 (sqrt(0.08)); noises 0.4 and 0.6, mean 0.5, sd 0.141
    assert "| DIFF | 0 | 0.100 ± 0.283 | 0.500 ± 0.141 | 0, 0 |" in table, table
    assert ("| DIFF | 0.2 | undefined (seed 1: every head excluded) | undefined (seed 1: every head excluded) | 2, 3 |"
            in table), table
    assert "the figures above use 0.1" in table[0]


def test_paper_small_text_only_without_corpus_is_refused(tmp_path):
    """--tasks text with no corpus has nothing to run: one line naming --data, not an empty report with exit 0."""
    benchmark = load_paper_small()
    with pytest.raises(SystemExit, match="needs a UTF-8 corpus.*pass --data FILE"):
        benchmark.main(["--tasks", "text", "--data", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir()), "nothing may be written"


def test_paper_small_runs_are_keyed_by_the_corpus_content(tmp_path):
    """The same corpus at another path is the same stored run; another corpus at the same name is another; the
    retrieval runs do not read it."""
    benchmark = load_paper_small()
    (tmp_path / "elsewhere").mkdir()
    same, moved, other = tmp_path / "corpus.txt", tmp_path / "elsewhere" / "copy.txt", tmp_path / "other.txt"
    same.write_text("To be, or not to be.\n")
    moved.write_text("To be, or not to be.\n")
    other.write_text("To be, or not to be?\n")

    def path(task: str, data: Path) -> Path:
        args = benchmark.parse_args(["--data", str(data), "--output-dir", str(tmp_path)])
        return benchmark.stored_path((task, "DIFF", 0, 800, args))

    assert path("text", same) == path("text", moved)
    assert path("text", same) != path("text", other)
    assert path("retrieval", same) == path("retrieval", other) == path("retrieval", tmp_path / "missing.txt")


COMMITTED_QUICK = Path(__file__).parents[1] / "benchmarks" / "paper_small" / "quick"


def test_paper_small_committed_report_recomputes_from_committed_weights(tmp_path):
    """A clone holds the weights behind its tables: the committed toy-size retrieval run (benchmarks/paper_small/
    quick, bf16 safetensors with their sha256 in the stored runs) recomputed with --from-saved writes its committed
    report (accuracy, normalised / raw / share attention, pooled and per-branch outliers, quantization): the same
    text, each figure to its printed digits (`printed_differences`: on another CPU a value at a rounding boundary
    may print one unit apart)."""
    benchmark = load_paper_small()
    out = tmp_path / "quick"
    shutil.copytree(COMMITTED_QUICK, out, ignore=shutil.ignore_patterns("*.png"))
    benchmark.main(["--quick", "--tasks", "retrieval", "--seeds", "0", "--eval-samples", "1", "--output-dir", str(out),
                    "--from-saved"])
    found = printed_differences((out / "report.md").read_text(), (COMMITTED_QUICK / "report.md").read_text())
    assert not found, "recomputed report vs the committed one:\n" + "\n".join(found)


# The in-memory model cast to bf16 and back keeps its rotary frequencies rounded to bf16; the loaded one recomputes
# them in fp32: logits differ by ~1e-5.
SAVED_ATOL = 1e-4


def test_paper_small_initialisation_survives_the_saved_model(tmp_path):
    """--init embed-sqrt on every family, by lm_scaling's apply_init: the model loaded back from its saved folder
    (`load_saved`, from which every reported number is computed) gives the logits of the trained model in the bf16
    weights it saved (to SAVED_ATOL); loaded without the embedding hook (a planted bug) it does not."""
    benchmark = load_paper_small()
    args = benchmark.parse_args(["--quick", "--init", "embed-sqrt", "--examples", "8"])
    plain_args = argparse.Namespace(**{**vars(args), "init": "llama"})
    tokenizer, data, _ = benchmark.retrieval_data(args)
    for name in benchmark.MODELS:
        torch.manual_seed(0)
        model = benchmark.lm_scaling.apply_init(benchmark.build_models(len(tokenizer), args)[name], args.init)
        benchmark.save_model(model, tokenizer, tmp_path / name)  # leaves the model in bf16
        with torch.no_grad():
            expected = model.float().eval()(data[:2]).logits
            got = benchmark.load_saved(tmp_path / name, args)(data[:2]).logits
            plain = benchmark.load_saved(tmp_path / name, plain_args)(data[:2]).logits
        diff = (got - expected).abs()
        assert diff.max() < SAVED_ATOL, f"{name}: max diff {diff.max():.3e}, mean {diff.mean():.3e}"
        assert (plain - expected).abs().max() > 100 * SAVED_ATOL, f"{name}: loaded without the hook, the same logits"


def test_paper_small_initialisation_and_rate_key_the_stored_runs(tmp_path):
    """A run's stored name follows its initialisation and learning rate (Llama's initialisation keeps the earlier
    names, so the committed runs are found); the study's own settings (grid, fraction, inits) do not change it."""
    benchmark = load_paper_small()
    args = benchmark.parse_args(["--quick", "--output-dir", str(tmp_path)])
    path = lambda a: benchmark.stored_path(("retrieval", "DIFF", 0, a.steps, a))
    base = path(args)
    assert path(benchmark.run_args(args, "llama", args.lr)) == base
    assert path(benchmark.run_args(args, "embed-sqrt", args.lr)) != base
    assert path(benchmark.run_args(args, "llama", 2 * args.lr)) != base
    study = benchmark.parse_args(["--quick", "--output-dir", str(tmp_path), "--study", "--inits", "llama",
                                  "--lrs", "1e-3", "--sweep-fraction", "0.5"])
    assert path(study) == base
    # a study's text runs are the same with or without its long run; the long run is keyed by its length
    text = lambda a, task="text": benchmark.stored_path((task, "DIFF", 0, a.text_steps, a))
    with_long, without = (benchmark.parse_args(["--quick", "--output-dir", str(tmp_path), "--study", "--tasks", "text",
                                                "--long-steps", steps]) for steps in ("80", "0"))
    assert text(benchmark.run_args(with_long, "embed-sqrt", 1e-3)) == text(benchmark.run_args(without, "embed-sqrt",
                                                                                               1e-3))
    long = lambda a: text(benchmark.run_args(a, "embed-sqrt", 1e-3, long=True), "text-long")
    assert long(with_long) != long(benchmark.parse_args(["--quick", "--output-dir", str(tmp_path), "--study",
                                                         "--tasks", "text", "--long-steps", "160"]))


def study_row(model: str, init: str, seed: int, loss: float) -> dict:
    return {"task": "text", "model": model, "init": init, "seed": seed, "val_loss": loss, "seconds": 600.0}


def test_paper_small_study_report_by_hand():
    """The study's tables: every family at every initialisation with its swept rate and its gap to Llama at the same
    initialisation, and each family at its best against Llama at its own best (paired by seed, 90% t interval)."""
    benchmark = load_paper_small()
    args = benchmark.parse_args(["--study", "--tasks", "text", "--inits", "llama", "embed-sqrt", "--seeds", "0", "1",
                                 "2", "--long-steps", "0"])
    finals = {("llama", "DIFF"): (4.0, 4.1, 3.9), ("llama", "DiffLlama"): (3.9, 3.95, 3.85),
              ("llama", "Transformer"): (3.6, 3.62, 3.58), ("embed-sqrt", "DIFF"): (3.5, 3.6, 3.55),
              ("embed-sqrt", "DiffLlama"): (3.7, 3.7, 3.75), ("embed-sqrt", "Transformer"): (3.62, 3.64, 3.66)}
    rows = [study_row(m, init, s, v) for (init, m), values in finals.items() for s, v in enumerate(values)]
    lrs = {init: {m: 2e-3 if m == "DIFF" else 1e-3 for m in benchmark.MODELS} for init in args.inits}
    found = {"task": "text", "grid": [1e-3, 2e-3, 4e-3], "sweep_steps": 200, "lr": lrs, "rows": rows,
             "sweep": {init: {m: {"0.001": 4.5, "0.002": 4.4, "0.004": 4.6} for m in benchmark.MODELS}
                       for init in args.inits},
             "best_init": {"DIFF": "embed-sqrt", "DiffLlama": "embed-sqrt", "Transformer": "llama"},
             "sweep_seconds": 7200.0}
    report = benchmark.study_report(found, args, "python benchmarks/paper_small.py --study")
    # DIFF - Llama at llama: +0.40, +0.48, +0.32: mean +0.4, sd 0.08, half width 2.920 * 0.08 / sqrt(3) = 0.1349
    assert "| llama | DIFF | 0.002 | 4.000, 4.100, 3.900 | 4.000 ± 0.100 | +0.4000 +- 0.0800 [+0.2651, +0.5349]: " \
           "DIFF higher |" in report
    assert "| llama | Llama | 0.001 | 3.600, 3.620, 3.580 | 3.600 ± 0.020 |  |" in report
    # DIFF at embed-sqrt - Llama at llama: -0.10, -0.02, -0.03: mean -0.05, sd 0.0436, half width 0.0735
    assert "| DIFF | embed-sqrt | 0.002 | 3.500, 3.600, 3.550 | 3.550 ± 0.050 | -0.0500 +- 0.0436 [-0.1235, " \
           "+0.0235]: interval covers 0 |" in report
    assert "| 0.002 | 4.400 | 4.400 |" in report
    assert ("at the edge of the grid for DiffLlama llama, Llama llama, DiffLlama embed-sqrt, Llama embed-sqrt."
            in report), "DIFF's 0.002 is inside the grid 0.001-0.004, the others' 0.001 at its edge"
    assert "the 18 runs above 3.00 hours, the sweep runs 2.00 hours" in report


def test_paper_small_long_run_reading_by_hand():
    """The long run's line: passes over the training blocks (steps x batch / blocks), the step of the lowest loss,
    how many families rose after it, and the full runs' sd over seeds beside a one-seed run."""
    benchmark = load_paper_small()
    curve = lambda *losses: [{"step": 400 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]
    long = [{"model": "DIFF", "steps": 1200, "curve": curve(3.9, 3.6, 3.8), "val_loss": 3.8, "best_val_loss": 3.6},
            {"model": "Transformer", "steps": 1200, "curve": curve(3.9, 3.7, 3.65), "val_loss": 3.65,
             "best_val_loss": 3.65}]
    full = [{**study_row("DIFF", "llama", s, v), "steps": 400} for s, v in enumerate((4.0, 4.1, 3.9))] + \
           [{**study_row("Transformer", "llama", s, v), "steps": 400} for s, v in enumerate((3.6, 3.62, 3.58))]
    line = benchmark.long_run_reading(long, full, sequences=800, batch=16)
    # 1200 * 16 / 800 = 24.0 passes, 400 steps: 8.0; lowest at 800 (DIFF, 16.0 passes) and 1,200 (Llama, 24.0)
    assert line.startswith("1,200 steps of 16 blocks are 24.0 passes over the 800 training blocks (the full runs' "
                           "400 steps: 8.0). The validation loss was lowest at step 800 / 1,200 (16.0 / 24.0 passes) "
                           "and rose after it for 1 of 2 families"), line
    assert line.endswith("sd over seeds is 0.020 to 0.100)."), line


@pytest.mark.slow
def test_paper_small_study_end_to_end_and_resumed(tmp_path, monkeypatch):
    """--study at toy size: a sweep per family and initialisation, every seed at the swept best rate and
    initialisation, reported; called again, it trains nothing and writes the same report."""
    benchmark = load_paper_small()
    argv = ["--quick", "--study", "--tasks", "retrieval", "--inits", "llama", "embed-sqrt", "--models", "DIFF",
            "Transformer", "--seeds", "0", "1", "--steps", "4", "--lrs", "3e-3", "6e-3", "--examples", "24",
            "--eval-samples", "1", "--curve-points", "2", "--output-dir", str(tmp_path)]
    report = benchmark.main(argv)
    assert "Generated by `python benchmarks/paper_small.py --quick --study --tasks retrieval" in report
    found = json.loads((tmp_path / "retrieval" / "results.json").read_text())
    assert found["sweep_steps"] == 2 and sorted(found["sweep"]) == ["embed-sqrt", "llama"]
    for init in ("llama", "embed-sqrt"):
        for model in ("DIFF", "Transformer"):
            sweep = found["sweep"][init][model]
            assert found["lr"][init][model] == float(min(sweep, key=sweep.get)), (init, model, sweep)
            runs = [r for r in found["rows"] if r["model"] == model and r["init"] == init]
            assert sorted(r["seed"] for r in runs) == [0, 1] and {r["lr"] for r in runs} == {found["lr"][init][model]}
            assert f"| {init} | {benchmark.SHOWN[model]} | {found['lr'][init][model]:g} |" in report
    monkeypatch.setattr(benchmark, "run_unit", lambda unit: pytest.fail(f"trained {unit[:4]} again"))
    assert benchmark.main(argv) == report
