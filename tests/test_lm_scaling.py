"""The single-epoch LM comparison's arithmetic (benchmarks/lm_scaling.py) on hand-made curves with known E, A, alpha:
the power-law fit, the token ratio at matched loss, the paired bootstrap, the loss gap, and a report that
`--from-saved` rewrites byte for byte. No corpus, no training."""

import json
import math
import sys

import numpy as np
import pytest
import torch
from helpers import (
    assert_layer_matches_reference,
    attention_params,
    randomize_gains,
    reference_branch_maps,
    reference_lambda,
    load_benchmark,
    reference_projections,
)

lm_scaling = load_benchmark("lm_scaling")

TOKENS = [int(t) for t in np.geomspace(25_000, 800_000, 10)]


def law(e: float, a: float, alpha: float, offset: float = 0.0) -> list[dict]:
    """A curve exactly on L(T) = E + A (T/1M)^-alpha (+ offset), with the train loss 0.1 above."""
    val = [e + offset + a * (t / 1e6) ** -alpha for t in TOKENS]
    return [{"step": i + 1, "tokens": t, "val_loss": v, "train_loss": v + 0.1}
            for i, (t, v) in enumerate(zip(TOKENS, val))]


def test_fit_recovers_known_parameters():
    for e, a, alpha in [(1.2, 0.8, 0.35), (2.0, 0.05, 1.1), (0.0, 3.0, 0.07)]:
        curve = law(e, a, alpha)
        fit = lm_scaling.fit_power_law([p["tokens"] for p in curve], [p["val_loss"] for p in curve])
        got, want = np.array([fit["E"], fit["A"], fit["alpha"]]), np.array([e, a, alpha])
        err = np.abs(got - want)
        assert err.max() < 2e-4, f"fit {got} vs {want}: max diff {err.max():.2e}, mean {err.mean():.2e}"
        assert fit["rmse"] < 1e-6
        assert lm_scaling.tokens_for_loss(fit, lm_scaling.fitted_loss(fit, 300_000)) == pytest.approx(300_000, rel=1e-6)


def test_fit_keeps_the_floor_non_negative_and_a_falling_curve():
    curve = law(-0.5, 2.0, 0.2)  # best unconstrained fit has E < 0
    fit = lm_scaling.fit_power_law([p["tokens"] for p in curve], [p["val_loss"] for p in curve])
    assert fit["E"] == 0.0 and fit["A"] > 0
    assert lm_scaling.tokens_for_loss({"E": 2.0, "A": 1.0, "alpha": 0.5}, 1.9) == math.inf


def test_token_ratio_is_known_ratio_and_paired_bootstrap_keeps_it():
    """DIFF with A scaled by r^alpha reaches Llama's end loss at r times the tokens. Per-seed offsets shared by a
    pair move both mean curves alike, so every paired bootstrap draw gives r exactly; an unpaired one would not."""
    r, alpha = 0.64, 0.3
    offsets = [-0.03, 0.0, 0.05]
    curves = {"DIFF": [law(1.5, 0.5 * r ** alpha, alpha, o) for o in offsets],
              "Llama": [law(1.5, 0.5, alpha, o) for o in offsets]}
    stats = lm_scaling.analyse(curves, skip=0, samples=300)
    ratio, inverse = stats["ratio"]["diff_over_llama"], stats["ratio"]["llama_over_diff"]
    for key in ("estimate", "p05", "p95"):
        assert ratio[key] == pytest.approx(r, rel=1e-3), (key, ratio)
        assert inverse[key] == pytest.approx(1 / r, rel=1e-3), (key, inverse)
    # the interpolated crossing, in log T on the measured points, is close to r too
    assert stats["interpolated_ratio"] == pytest.approx(r, rel=0.02)


def test_bootstrap_interval_spreads_with_unpaired_noise():
    r, alpha = 0.64, 0.3
    curves = {"DIFF": [law(1.5, 0.5 * r ** alpha, alpha, o) for o in (-0.02, 0.0, 0.03)],
              "Llama": [law(1.5, 0.5, alpha, o) for o in (0.02, 0.01, -0.03)]}
    ratio = lm_scaling.analyse(curves, skip=0, samples=400)["ratio"]["diff_over_llama"]
    assert ratio["p05"] < ratio["estimate"] < ratio["p95"], ratio
    assert ratio["p95"] - ratio["p05"] > 0.1, ratio


def test_final_gap_per_seed_mean_and_sd():
    curves = {"DIFF": [law(1.5, 0.4, 0.3, o) for o in (0.0, 0.1, 0.3)], "Llama": [law(1.5, 0.4, 0.3, 0.0)] * 3}
    stats = lm_scaling.analyse(curves, skip=0, samples=50)
    assert stats["gap"]["per_seed"] == pytest.approx([0.0, 0.1, 0.3])
    assert stats["gap"]["mean"] == pytest.approx(0.4 / 3)
    assert stats["gap"]["sd"] == pytest.approx(np.std([0.0, 0.1, 0.3], ddof=1))
    half = 2.920 * np.std([0.0, 0.1, 0.3], ddof=1) / math.sqrt(3)  # t_0.95 with 2 degrees of freedom
    assert stats["gap"]["t90"] == pytest.approx([0.4 / 3 - half, 0.4 / 3 + half])
    assert stats["final"]["Llama"]["sd"] == pytest.approx(0.0, abs=1e-12)


def test_percentile_counts_inf_as_largest():
    assert lm_scaling.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert lm_scaling.percentile([1.0, 2.0], 50) == pytest.approx(1.5)
    assert lm_scaling.percentile([1.0, math.inf, math.inf], 95) == math.inf
    assert lm_scaling.percentile([1.0, 2.0, math.inf], 5) == pytest.approx(1.1)


def test_eval_steps_are_log_spaced_and_end_at_the_last_step():
    steps = lm_scaling.eval_steps(400, 10)
    assert steps[-1] == 400 and len(steps) == 10 and steps[0] == 12
    ratios = np.diff(np.log(steps))
    assert ratios.max() / ratios.min() < 1.5


# final-loss shift of each family at each initialisation: DIFF is best at embed-sqrt, Llama ties llama/embed-sqrt
# (the first in INITS order, llama, is its best)
INIT_SHIFT = {"DIFF": {"llama": 0.1, "embed-sqrt": 0.0, "out-depth": 0.05, "embed-sqrt+out-depth": 0.02},
              "Llama": {"llama": 0.0, "embed-sqrt": 0.0, "out-depth": 0.03, "embed-sqrt+out-depth": 0.04}}


def study_entry(m: str, init: str, cfg: dict, lr: float) -> dict:
    offsets = {"DIFF": (0.01, -0.02, 0.0), "Llama": (0.0, 0.01, -0.01)}
    seeds = {str(s): {"curve": law(1.5, 0.5 if m == "Llama" else 0.45, 0.3, offsets[m][s] + INIT_SHIFT[m][init]),
                      "seconds": 1.0} for s in cfg["seeds"]}
    sweep = {f"{x:g}": {"curve": law(1.6 + abs(x - lr), 0.5, 0.3)[:4], "seconds": 1.0} for x in cfg["lrs"]}
    return {"lr": lr, "sweep": sweep, "seeds": seeds}


def fake_results() -> dict:
    cfg = dict(lm_scaling.FULL, steps=len(TOKENS), seeds=[0, 1, 2], lrs=[2e-3, 4e-3, 8e-3])
    lrs = {"DIFF": 4e-3, "Llama": 8e-3}
    inits = {init: {m: study_entry(m, init, cfg, lrs[m]) for m in lm_scaling.MODELS} for init in lm_scaling.INITS}
    best = {"DIFF": "embed-sqrt", "Llama": "llama"}
    corpus = dict(name="Django", version="5.1.4", file="x", sha256="0" * 64, license="BSD-3-Clause",
                  bytes=11_471_364, content_sha256="1" * 64)
    return {"command": "python benchmarks/lm_scaling.py", "config": cfg, "corpus": corpus, "quick": False,
            "lr": lrs, "fit_skip": 1, "chosen_init": "embed-sqrt", "best_init": best,
            "parameters": {"DIFF": 468_384, "Llama": 467_808},
            "runs": {"main": {m: inits[best[m]][m]["seeds"] for m in lm_scaling.MODELS}, "controls": {}},
            "studies": {"inits": inits, "controls": {}}}


def test_report_from_saved_is_byte_for_byte(tmp_path, monkeypatch):
    results = fake_results()
    first = lm_scaling.render(results)
    assert first == lm_scaling.render(json.loads(json.dumps(results)))
    assert "| DIFF | 468,384 | embed-sqrt | 0.004 |" in first and "| Llama | 467,808 | llama | 0.008 |" in first
    assert "edge of the grid for Llama llama, Llama embed-sqrt" in first  # 8e-3 is the grid's largest
    (tmp_path / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(sys, "argv", ["lm_scaling.py", "--from-saved", "--output-dir", str(tmp_path)])
    lm_scaling.main()
    assert (tmp_path / "report.md").read_text() == first
    assert {p.name for p in tmp_path.iterdir()} <= {"report.md", "results.json", "loss.png"}


def test_initialisation_table_by_hand():
    """Every variant's rows, in INITS order, with the paired DIFF - Llama gap and its verdict."""
    report = lm_scaling.render(fake_results())
    # finals: DIFF 1.5 + 0.45 * 0.8^-0.3 = 1.98114 + offset + shift; Llama 1.5 + 0.5 * 0.8^-0.3 = 2.03460 + ...
    # llama: DIFF 2.0912, 2.0612, 2.0812; Llama 2.0346, 2.0446, 2.0246: gaps +0.0566, +0.0166, +0.0566, mean
    # +0.0432, sd 0.0231, half width 2.920 * 0.0231 / sqrt(3) = 0.0389
    assert ("| llama | DIFF | 0.004 | 2.0912, 2.0612, 2.0812 | 2.0778 +- 0.0153 | +0.0432 +- 0.0231 "
            "[+0.0043, +0.0821]: DIFF higher |") in report
    # embed-sqrt: gaps -0.0434, -0.0834, -0.0434: mean -0.0568, interval [-0.1957, +0.0821]... by the same sd
    assert "| embed-sqrt | DIFF | 0.004 | 1.9912, 1.9612, 1.9812 | 1.9778 +- 0.0153 | -0.0568 +- 0.0231 " in report
    assert "[-0.0957, -0.0179]: DIFF lower |" in report
    rows = [line.split(" | ")[0] for line in report.splitlines()
            if line.startswith("| ") and " | DIFF | 0.004 |" in line]
    assert rows == ["| llama", "| embed-sqrt", "| out-depth", "| embed-sqrt+out-depth"]
    # each family against itself at llama, e.g. DIFF at embed-sqrt: -0.1 on every seed
    assert "- embed-sqrt: DIFF -0.1000 +- 0.0000 [-0.1000, -0.1000]; Llama +0.0000 +- 0.0000" in report
    assert "DIFF's lowest mean final loss is at `embed-sqrt`" in report
    assert "(`DiffConfig().embedding_multiplier` = sqrt(hidden)) is `embed-sqrt`, the same" in report


def test_package_default_is_the_studied_variant():
    """lm_scaling's name for the package's default and DiffConfig's default are one initialisation."""
    from diff_transformer import DiffConfig

    spec = lm_scaling.INITS[lm_scaling.PACKAGE_DEFAULT]
    config = DiffConfig(hidden_size=96, num_attention_heads=2)
    assert spec["embed_sqrt"] and config.embedding_multiplier == math.sqrt(96)
    assert not spec["out_depth"]  # DiffConfig's init leaves the output projections at Llama's std


def test_initialisations_apply_alike_to_both_families():
    """embed-sqrt: the first layer reads sqrt(hidden) x E[ids] in both; out-depth: o_proj and down_proj scaled by
    1/sqrt(2 layers) from the same seed's Llama init, every other weight unchanged."""
    cfg = dict(lm_scaling.FULL, layers=2, hidden=32, head_dim=8, context=16)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    for name in ("DIFF", "Llama"):
        base = lm_scaling.build_model(name, cfg, 0)
        scaled = lm_scaling.build_model(name, cfg, 0, "embed-sqrt")
        with torch.no_grad():
            first = scaled(ids, output_hidden_states=True).hidden_states[0]
        assert torch.equal(first, base.get_input_embeddings().weight[ids] * math.sqrt(32)), name
        deep = dict(lm_scaling.build_model(name, cfg, 0, "out-depth").named_parameters())
        for key, value in base.named_parameters():
            factor = 0.5 if key.endswith(("o_proj.weight", "down_proj.weight")) else 1.0  # 1 / sqrt(2 * 2)
            assert torch.equal(deep[key], value * factor), (name, key)


@pytest.mark.parametrize("init", ["embed-sqrt", "embed-sqrt+out-depth", "out-depth"])
def test_saved_model_computes_what_was_trained(init, tmp_path):
    """`save_model` (what benchmarks/quantization.py --lm-scaling measures): a DIFF or Llama model of any init, loaded
    by from_pretrained without the benchmark's hook, gives the trained model's logits; embed-sqrt becomes DIFF's
    embedding_multiplier (once: a double or missing scale fails), and a Llama that would need it is refused."""
    from transformers import AutoModelForCausalLM

    cfg = dict(lm_scaling.FULL, layers=2, hidden=32, head_dim=8, context=16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for name in ("DIFF", "Llama"):
        model = lm_scaling.build_model(name, cfg, 0, init).eval()
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, 0.5)  # an embedding far from the init's, so scale shows
            expected = model(ids).logits
        if name == "Llama" and lm_scaling.INITS[init]["embed_sqrt"]:
            with pytest.raises(ValueError, match="embedding_multiplier"):
                lm_scaling.save_model(model, init, tmp_path / name)
            assert not (tmp_path / name).exists()
            continue
        lm_scaling.save_model(model, init, tmp_path / name)
        assert getattr(model.config, "embedding_multiplier", 1.0) == 1.0, "save_model changed the live model's config"
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        with torch.no_grad():
            got = loaded(ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5,
                                   msg=lambda m, name=name: f"{name} {init}: {m}")


def test_missing_corpus_names_the_command(tmp_path):
    with pytest.raises(SystemExit, match=r"pip download --no-deps --no-binary :all: -d .* Django==5\.1\.4"):
        lm_scaling.corpus_archive(tmp_path, fetch=False)


def test_runs_are_stored_once_per_settings_and_corpus(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"curve": law(1.5, 0.5, 0.3), "seconds": 1.0}

    settings = {"model": "DIFF", "lr": 4e-3, "seed": 0, "steps": 10, "corpus": "a" * 64}
    first = lm_scaling.cached_run(tmp_path, settings, compute)
    assert lm_scaling.cached_run(tmp_path, dict(settings), compute) == first and len(calls) == 1
    lm_scaling.cached_run(tmp_path, dict(settings, corpus="b" * 64), compute)  # other corpus content: another run
    assert len(calls) == 2
    assert sorted(p.suffix for p in (tmp_path / "runs").iterdir()) == [".json", ".json"]  # no temporary file left


def test_head_count_control_gaps_by_hand():
    results = fake_results()
    finals = {"Llama-h": (2.0, 2.1, 2.3), "DIFF-2h": (1.9, 1.9, 2.0), "DIFF-lambda0": (2.0, 2.0, 2.0),
              "DIFF-noSubLN": (1.8, 1.8, 1.8)}
    finals |= {"DIFF-V2": (2.0, 1.9, 2.0), "DIFF-plus": (2.1, 2.0, 2.05), "DIFF-lambda-frozen": (1.99, 1.97, 1.98)}
    control_lr = {"Llama-h": 8e-3, "DIFF-2h": 4e-3, "DIFF-lambda0": 4e-3, "DIFF-noSubLN": 1.6e-2, "DIFF-V2": 2e-3,
                  "DIFF-plus": 8e-3, "DIFF-lambda-frozen": 4e-3}
    results["runs"]["controls"] = {m: {str(s): {"curve": [{"step": 1, "tokens": 1, "val_loss": v, "train_loss": v}],
                                                "seconds": 1.0} for s, v in enumerate(finals[m])}
                                   for m in lm_scaling.CONTROLS}
    results["studies"]["controls"] = {m: {"lr": control_lr[m], "seeds": results["runs"]["controls"][m]}
                                      for m in lm_scaling.CONTROLS}
    results["parameters"] |= {"Llama-h": 467_808, "DIFF-2h": 468_480, "DIFF-lambda0": 468_384, "DIFF-noSubLN": 468_192,
                              "DIFF-V2": 486_816, "DIFF-plus": 468_384, "DIFF-lambda-frozen": 468_384}
    report = lm_scaling.render(results)
    assert report == lm_scaling.render(json.loads(json.dumps(results)))
    # cfg: hidden 96, head_dim 24 -> h = 2; each control at its own swept learning rate; DIFF and Llama at the
    # chosen initialisation (embed-sqrt), whose finals are DIFF 1.9912, 1.9612, 1.9812 and Llama 2.0346, 2.0446, 2.0246
    assert "| Llama-h | 2 x 48 | 467,808 | 0.008 | 2.0000, 2.1000, 2.3000 | 2.1333 +- 0.1528 |" in report
    assert "| DIFF-2h | 4 x 12 | 468,480 | 0.004 | 1.9000, 1.9000, 2.0000 | 1.9333 +- 0.0577 |" in report
    # DIFF-2h - DIFF per seed: DIFF's finals are 1.9912, 1.9612, 1.9812 -> -0.0912, -0.0612, +0.0188
    # mean -0.0445, sd 0.0569, half width 2.920 * 0.0569 / sqrt(3) = 0.0959
    assert "- DIFF-2h - DIFF (DIFF, 2h heads against h): -0.0445 +- 0.0569 [-0.1404, +0.0514]" in report
    # Llama-h - Llama: Llama's finals 2.0346, 2.0446, 2.0246 -> -0.0346, +0.0554, +0.2754: mean +0.0987
    assert "- Llama-h - Llama (Llama, h heads against 2h): +0.0987" in report
    # DIFF - DIFF-lambda0: -0.0088, -0.0388, -0.0188 (to 4 places): mean -0.0222, sd 0.0153
    assert "- DIFF - DIFF-lambda0 (lambda learned against held at 0: the second branch disabled): -0.0222 +- 0.0153" \
        in report
    # DIFF's finals unrounded: 1.9911556, 1.9611556, 1.9811556
    # DIFF - DIFF-plus: -0.10884, -0.03884, -0.06884: mean -0.0722, sd 0.0351, half width 2.920 * 0.0351 / sqrt(3)
    assert ("- DIFF - DIFF-plus (A1 - lambda A2 against A1 + lambda A2: the sign alone): -0.0722 +- 0.0351 "
            "[-0.1314, -0.0130]: DIFF lower") in report
    # DIFF - DIFF-lambda-frozen: +0.00116, -0.00884, +0.00116: mean -0.0022, sd 0.0058
    assert ("- DIFF - DIFF-lambda-frozen (lambda learned against fixed at lambda_init): -0.0022 +- 0.0058 "
            "[-0.0119, +0.0076]: interval covers 0") in report
    assert "| DIFF-plus | 2 x 24 | 468,384 | 0.008 | 2.1000, 2.0000, 2.0500 |" in report
    assert "DIFF-plus computes A1 + lambda A2" in report and "DIFF-lambda-frozen fixes lambda" in report
    assert "| DIFF-lambda0 | 2 x 24 | 468,384 | 0.004 | 2.0000, 2.0000, 2.0000 | 2.0000 +- 0.0000 |" in report
    assert "- DIFF - DIFF-noSubLN (SubLN against none): +0.1778 +- 0.0153" in report
    assert "| DIFF-noSubLN | 2 x 24 | 468,192 | 0.016 |" in report
    assert "| DIFF-V2 | 4 x 24 | 486,816 | 0.002 |" in report
    # DIFF-V2 - DIFF: +0.00885, -0.06115, +0.01885: mean -0.01115, sd 0.0436, half width 0.0735: covers 0
    assert "- DIFF-V2 - DIFF (DIFF V2 against V1): -0.0112 +- 0.0436 [-0.0846, +0.0623]: interval covers 0" in report
    assert "## Controls, on `embed-sqrt`" in report
    results["runs"]["controls"].pop("DIFF-lambda0")  # a control not stored: its rows left out
    assert "lambda0 |" not in lm_scaling.render(results) and "| DIFF-2h |" in lm_scaling.render(results)


@pytest.mark.parametrize("name", ["DIFF-lambda0", "DIFF-lambda-frozen"])
def test_fixed_lambda_controls_keep_lambda_through_training(name):
    """lambda held at 0 (DIFF-lambda0) or at each layer's lambda_init (DIFF-lambda-frozen): zero lambda vectors get
    no gradient and AdamW's weight decay leaves them at 0."""
    cfg = dict(lm_scaling.FULL, layers=2, hidden=32, head_dim=8, context=16)
    model = lm_scaling.build_model(name, cfg, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for i, layer in enumerate(model.model.layers):
        lam = layer.self_attn.lambda_params
        fixed = 0.0 if name == "DIFF-lambda0" else model.config.layer_lambda_init(i)
        assert all(float(p.detach().abs().max()) == 0.0 for p in lam.parameters()), "a lambda vector moved off 0"
        assert float(lam().detach()) == pytest.approx(fixed, abs=1e-7) and lam.lambda_init == pytest.approx(fixed)
    if name == "DIFF-lambda-frozen":
        assert model.model.layers[1].self_attn.lambda_params.lambda_init > 0.2, "the schedule's lambda_init, not 0"


@pytest.mark.parametrize("name", ["DIFF", "Llama", *lm_scaling.CONTROLS])
def test_head_layouts_keep_every_projection_shape(name):
    cfg = dict(lm_scaling.FULL, layers=1)
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items() if "proj" in k}
    model = lm_scaling.build_model(name, cfg, 0)
    expected = shapes(lm_scaling.build_model("Llama", cfg, 0))  # every projection as in Llama
    if name == "DIFF-V2":  # but V2's doubled queries and its lambda projection (h = 4 heads of 24)
        expected |= {"model.layers.0.self_attn.q_proj.weight": (2 * 96, 96),
                     "model.layers.0.self_attn.lambda_proj.weight": (4, 96)}
    assert shapes(model) == expected
    attention = model.model.layers[0].self_attn
    if lm_scaling.head_layout(name, cfg)[0] == "DIFF" and name != "DIFF-V2":  # SubLN in all but DIFF-noSubLN
        assert isinstance(attention.subln, torch.nn.Identity) == (name == "DIFF-noSubLN")
    assert lm_scaling.head_layout(name, cfg)[1] == {"DIFF": 2, "Llama": 4, "Llama-h": 2, "DIFF-2h": 4,
                                                          "DIFF-lambda0": 2, "DIFF-noSubLN": 2, "DIFF-V2": 4,
                                                          "DIFF-plus": 2, "DIFF-lambda-frozen": 2}[name]


def test_unreported_runs_travel_in_results_and_come_back(tmp_path):
    """Runs in the store that results.json does not report (controls of a stopped run) are kept in it, and a clone
    with results.json alone gets every run back into its store."""
    results = fake_results()
    reported = results["studies"]["inits"]["llama"]["DIFF"]["seeds"]["0"]
    reported["settings"] = {"model": "DIFF", "lr": 4e-3, "seed": 0, "steps": 10, "corpus": "a" * 64}
    pending = {"model": "DIFF-V2", "lr": 2e-3, "seed": 1, "steps": 10, "corpus": "a" * 64}
    for settings in (reported["settings"], pending):
        lm_scaling.cached_run(tmp_path, settings, lambda: {"curve": law(1.5, 0.5, 0.3), "seconds": 1.0})
    results["unreported_runs"] = lm_scaling.unreported_runs(tmp_path, results)
    assert [run["settings"] for run in results["unreported_runs"]] == [pending]
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "results.json").write_text(json.dumps(results))
    lm_scaling.import_stored_runs(clone)
    assert len(list((clone / "runs").glob("*.json"))) == 2
    calls = []
    lm_scaling.cached_run(clone, pending, lambda: calls.append(1) or {})
    assert not calls, "an imported run was trained again"


# --- the subtraction's controls: DIFF-plus (A1 + lambda A2) and DIFF-lambda-frozen (lambda fixed at lambda_init) ---
TINY = dict(lm_scaling.FULL, layers=2, hidden=32, head_dim=8, context=16)


def plus_reference(x: torch.Tensor, weights: dict, config, layer_idx: int) -> torch.Tensor:
    """(1 - lambda_init) SubLN((A1 + lambda A2) V) @ o^T in float64, from the causal softmax maps A1, A2 of the
    tests' reference (`reference_branch_maps`), not from the model's kernels."""
    a1, a2 = reference_branch_maps(x, weights, config)  # [B, h, T, T]
    _, _, v = reference_projections(x, weights, config)  # [B, h_kv, T, dv]
    lam, lam_init = reference_lambda(weights, config, layer_idx)
    v = v.repeat_interleave(a1.shape[1] // v.shape[1], dim=1)  # kv head of each differential head
    heads = ((a1 + lam * a2) @ v).transpose(1, 2)  # [B, T, h, dv]
    heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    return ((1 - lam_init) * heads * weights["subln"]).flatten(2) @ weights["o"].T


def test_plus_control_is_a1_plus_lambda_a2():
    """DIFF-plus's layer output and every gradient (input, projections, lambda vectors, SubLN gain) against the
    float64 reference of A1 + lambda A2; DIFF itself (A1 - lambda A2, the same weights) fails the same check, as a
    sign flip planted in the control would; inside `frozen_lambdas` (generate) the output is unchanged."""
    from diff_transformer.diff_lambda import frozen_lambdas

    def check(name: str) -> None:
        model = lm_scaling.build_model(name, TINY, 0).double()
        randomize_gains(model)
        attn = model.model.layers[1].self_attn
        x = torch.randn(2, 12, TINY["hidden"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        assert_layer_matches_reference(
            attn, model.model, x.requires_grad_(), None, attention_params(attn),
            lambda x_ref, weights, _: plus_reference(x_ref, weights, model.config, 1), torch.float32, name)

    check("DIFF-plus")
    with pytest.raises(AssertionError, match="output"):
        check("DIFF")
    model, batch = lm_scaling.build_model("DIFF-plus", TINY, 0).eval(), torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        free = model(batch).logits
        with frozen_lambdas(model):
            frozen = model(batch).logits
    assert torch.equal(free, frozen), f"frozen_lambdas changed DIFF-plus: max diff {(free - frozen).abs().max():.3e}"


def zero_gradient(name: str, cfg: dict) -> tuple[set[str], int]:
    """(names of the parameters whose gradient is exactly zero after one backward, parameter count)."""
    model = lm_scaling.build_model(name, cfg, 0)
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(batch, labels=batch).loss.backward()
    named = dict(model.named_parameters())
    return {n for n, p in named.items() if p.grad is None or not p.grad.any()}, sum(p.numel() for p in named.values())


def test_subtraction_controls_keep_diffs_parameters_and_gradient_flow():
    """At the benchmark's size: DIFF-plus and DIFF-lambda-frozen have DIFF's parameter count; every parameter of DIFF
    gets a nonzero gradient, and so does every one of DIFF-plus; DIFF-lambda-frozen differs by its lambda vectors
    alone; DIFF-lambda0 also cuts the second branch's queries and keys (the 37,248 parameters the docs quote)."""
    cfg = lm_scaling.FULL
    silent = {name: zero_gradient(name, cfg) for name in ("DIFF", "DIFF-plus", "DIFF-lambda-frozen", "DIFF-lambda0")}
    assert {name: count for name, (_, count) in silent.items()} == dict.fromkeys(silent, 468_384)
    assert silent["DIFF"][0] == set(), f"DIFF: no gradient to {sorted(silent['DIFF'][0])}"
    assert silent["DIFF-plus"][0] == set(), f"DIFF-plus: no gradient to {sorted(silent['DIFF-plus'][0])}"
    lambdas = {f"model.layers.{i}.self_attn.lambda_params.{v}" for i in range(cfg["layers"])
               for v in ("q1", "k1", "q2", "k2")}
    assert silent["DIFF-lambda-frozen"][0] == lambdas
    model = lm_scaling.build_model("DIFF-lambda0", cfg, 0)
    model(torch.randint(0, 256, (2, 16)), labels=torch.randint(0, 256, (2, 16))).loss.backward()
    second = sum(int((p.grad == 0).sum()) for n, p in model.named_parameters()
                 if n.endswith(("q_proj.weight", "k_proj.weight")) or "lambda_params" in n)
    assert second == 37_248, f"parameters without gradient in DIFF-lambda0: {second}"


def test_controls_option_names_the_choices():
    assert lm_scaling.control_names("plus,frozen") == ("DIFF-plus", "DIFF-lambda-frozen")
    with pytest.raises(Exception, match="unknown control minus: give some of llama-h, 2h, lambda0"):
        lm_scaling.control_names("plus,minus")
