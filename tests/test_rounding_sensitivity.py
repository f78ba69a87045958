"""benchmarks/rounding_sensitivity.py: the nudge is w * (1 + size * z) with fixed draws, applied after its step and
only there (a run nudged by 0 is the plain run, bit for bit); the plan pairs every run with its nudged twin; the
report's numbers by hand. No corpus: random blocks at toy size."""

import pytest
import torch
from helpers import load_benchmark

lm_scaling = load_benchmark("lm_scaling")
sensitivity = load_benchmark("rounding_sensitivity")
TINY = dict(lm_scaling.QUICK, context=16, batch=2, points=6)


def test_nudge_multiplies_every_weight_by_one_plus_size_times_a_fixed_draw():
    model = lm_scaling.build_model("DIFF", TINY, 0)
    before = [p.detach().clone() for p in model.parameters()]
    lm_scaling.nudge_weights(model, 0.5)
    generator = torch.Generator().manual_seed(0)
    for old, new in zip(before, model.parameters(), strict=True):
        expected = old * (1 + 0.5 * torch.randn(old.shape, generator=generator))
        torch.testing.assert_close(new.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["DIFF", "Llama"])
def test_a_run_nudged_by_zero_is_the_plain_run_and_a_nudge_acts_after_its_step(name):
    blocks = torch.randint(0, 256, (64, TINY["context"]), generator=torch.Generator().manual_seed(1))
    train, val = blocks[8:], blocks[:8]
    run = lambda nudge: lm_scaling.train_run(name, TINY, 3e-3, 0, 12, train, val, "embed-sqrt", nudge=nudge)["curve"]
    plain, zero, nudged = run(None), run((4, 0.0)), run((4, 1e-2))
    assert [p["val_loss"] for p in zero] == [p["val_loss"] for p in plain]
    for a, b in zip(plain, nudged, strict=True):
        if a["step"] < 4:
            assert a["val_loss"] == b["val_loss"], f"step {a['step']}: the nudge acted before its step"
        else:
            assert a["val_loss"] != b["val_loss"], f"step {a['step']}: no nudge after step 4"


def results(lrs: dict) -> dict:
    settings = lambda model, lr, seed: {"model": model, "init": "embed-sqrt", "lr": lr, "seed": seed, "steps": 12}
    curve = lambda final: [{"step": 6, "val_loss": final + 1}, {"step": 12, "val_loss": final}]
    return {"config": dict(TINY, steps=12),
            "runs": {"main": {m: {str(s): {"settings": settings(m, lr, s), "curve": curve(2.0 + 0.1 * s)}
                                  for s in (0, 1, 2)} for m, lr in lrs.items()}}}


def test_plan_pairs_every_reported_run_with_its_nudged_twin_and_swaps_rates():
    found = results({"DIFF": 4e-3, "Llama": 2e-3})
    plan = sensitivity.plan(found, [0, 3], swap_rates=True, at=18, size=1e-7)
    key = lambda s: (s["model"], s["lr"], s["seed"], tuple(s["nudge"]) if s["nudge"] else ())
    assert sorted(map(key, plan)) == sorted((m, lr, seed, nudge) for m in ("DIFF", "Llama") for lr in (4e-3, 2e-3)
                                            for seed in (0, 3) for nudge in ((), (18, 1e-7)))
    assert all(s["init"] == "embed-sqrt" and s["steps"] == 12 for s in plan)
    assert len(sensitivity.plan(found, [0], swap_rates=False, at=18, size=1e-7)) == 4
    assert len(sensitivity.plan(results({"DIFF": 4e-3, "Llama": 4e-3}), [0], True, 18, 1e-7)) == 4, \
        "families at one rate have no other rate to swap"


def test_report_by_hand():
    run = lambda model, seed, nudge, losses: {
        "settings": {"model": model, "init": "embed-sqrt", "lr": 4e-3, "seed": seed, "steps": 12, "nudge": nudge},
        "curve": [{"step": 6, "val_loss": losses[0]}, {"step": 12, "val_loss": losses[1]}]}
    runs = [run("DIFF", 0, None, (3.0, 2.0)), run("DIFF", 0, [6, 1e-7], (3.05, 1.98)),
            run("DIFF", 3, None, (3.0, 2.1)), run("DIFF", 3, [6, 1e-7], (2.9, 2.13))]
    rows = sensitivity.pairs(runs)
    assert [(r["seed"], round(r["change"], 6), round(r["largest"], 6)) for r in rows] == [(0, -0.02, 0.05),
                                                                                        (3, 0.03, -0.1)]
    text = sensitivity.report(rows, 12, [6, 1e-7], "python benchmarks/rounding_sensitivity.py")
    assert "| DIFF | embed-sqrt | 0.004 | 0 | 2.0000 | 1.9800 | -2.0e-02 | +5.0e-02 |" in text
    # mean |change| (0.02 + 0.03) / 2; the plain finals 2.0 and 2.1: sd 0.0707
    assert "| DIFF | 0.004 | 2.5e-02 (2 seeds) | 0.0707 |" in text
    assert "after step 6 of 12" in text
