"""The paper's Figure 3 claim at small scale: single-epoch language modelling, DIFF against Llama at equal parameters.

Setup as in the paper (Ye et al., arXiv 2410.05258, §3.2-3.3): DIFF with h = H / (2d) differential heads of q/k
dim d (values 2d) against a Llama Transformer with 2h heads of dim d, same layers, MLP and vocabulary, so that every
projection has the same shape (DIFF adds only its lambda vectors and SubLN weights). AdamW, linear warm-up then
linear decay to 0; no token is seen twice. Both families get the same initialisations (INITS); for each model and
initialisation the learning rate is picked by a small sweep (one seed, a quarter of the budget); then it is trained
with paired seeds (same initialisation seed and same batch order per seed) and evaluated at ~10 log-spaced token
counts (validation loss on a fixed held-out set; training loss averaged since the previous point, on batches not
seen before). The headline compares each family at its best initialisation; the controls (CONTROLS) run on DIFF's:
`--controls plus,frozen` trains only those two (the subtraction's controls) and reports the others from stored runs.

The fit L(T) = E + A * T^-alpha per model, with a bootstrap over seeds (pairs resampled together), gives the token
ratio at matched loss: the tokens DIFF needs to reach the loss Llama reaches at the end of training, divided by
Llama's tokens (the paper reports ~0.64 at 3B), with its 90% interval; the final validation-loss gap is reported
per seed with mean and spread.

Corpus: the documentation (docs/**/*.txt) and source (django/**/*.py) of the pinned Django 5.1.4 source release
from PyPI (BSD-3-Clause), sha256-checked, concatenated in sorted file order, read as UTF-8 bytes (byte-level
tokens, vocabulary 256), cut into blocks of `--context` bytes, the blocks shuffled once with a fixed seed; the first
`--val-blocks` are the validation set.

    python benchmarks/lm_scaling.py --jobs 2          # sweeps + runs (resumable), then results.json and report.md
    python benchmarks/lm_scaling.py --quick           # the same pipeline at toy size, in about a minute
    python benchmarks/lm_scaling.py --from-saved      # report.md again from results.json, no training
    python benchmarks/lm_scaling.py --jobs 2 --controls plus,frozen   # the subtraction's controls only

Each finished run is stored in OUTPUT_DIR/runs under a key of its settings and the corpus content hash; a later
call skips it, so a stopped sweep resumes (an unfinished run restarts from its beginning).
"""

import argparse
import copy
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

CORPUS = dict(name="Django", version="5.1.4", file="Django-5.1.4.tar.gz",
              sha256="de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a", license="BSD-3-Clause",
              content_sha256="d28be51635835ea46eb15b20c18a3608711d9f2db0ee43ff4f42cfe35e05f05d")
FETCH = "pip download --no-deps --no-binary :all: -d {dir} Django==5.1.4"
MODELS = ("DIFF", "Llama")
DEFAULT_DIR = Path(__file__).parent / "lm_scaling"
FULL = dict(hidden=96, layers=4, head_dim=24, context=256, batch=8, steps=400, seeds=[0, 1, 2, 3],
            lrs=[1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2], sweep_fraction=0.25, points=10, val_blocks=64, warmup=0.05)
QUICK = dict(hidden=32, layers=2, head_dim=8, context=64, batch=4, steps=24, seeds=[0, 1, 2],
             lrs=[3e-3, 6e-3], sweep_fraction=0.5, points=5, val_blocks=8, warmup=0.1)
BOOTSTRAP = 2000
PAPER_RATIO = 0.64  # Figure 3b: DIFF matches the Transformer's loss with ~63.7% of the training tokens


# ----------------------------------------------------------------------------------------------------------- corpus
def corpus_archive(corpus_dir: Path, fetch: bool) -> Path:
    """The pinned release archive in `corpus_dir`, fetched there with pip when missing (and `fetch`), hash-checked."""
    path = corpus_dir / CORPUS["file"]
    command = FETCH.format(dir=corpus_dir)
    if not path.is_file() and fetch:
        corpus_dir.mkdir(parents=True, exist_ok=True)
        print(f"fetching the corpus: {command}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", *command.split()[1:]], check=False)
    if not path.is_file():
        sys.exit(f"corpus missing: {path}; get it with `{command}` (or give --corpus-dir where it is)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CORPUS["sha256"]:
        sys.exit(f"{path} has sha256 {digest}, expected {CORPUS['sha256']}; delete it and run `{command}`")
    return path


def corpus_bytes(archive: Path) -> bytes:
    """docs/**/*.txt then django/**/*.py of the release, each group in sorted path order, joined by a blank line."""
    root = CORPUS["file"].removesuffix(".tar.gz")
    wanted = lambda name: (name.startswith(f"{root}/docs/") and name.endswith(".txt")) or (
        name.startswith(f"{root}/django/") and name.endswith(".py"))
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and wanted(m.name)), key=lambda m: m.name)
        return b"\n\n".join(tar.extractfile(m).read() for m in members)


def blocks(data: bytes, context: int, val_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping blocks of `context` byte tokens, shuffled once (seed 0): (train [N, context], val)."""
    ids = torch.frombuffer(bytearray(data[: len(data) // context * context]), dtype=torch.uint8).long()
    ids = ids.view(-1, context)[torch.randperm(len(data) // context, generator=torch.Generator().manual_seed(0))]
    return ids[val_blocks:], ids[:val_blocks]


# ----------------------------------------------------------------------------------------------------------- models
CONTROLS = ("Llama-h", "DIFF-2h", "DIFF-lambda0", "DIFF-noSubLN", "DIFF-V2", "DIFF-plus",
            "DIFF-lambda-frozen")  # each with its own LR sweep
# zero lambda vectors get no gradient (d exp(<q, k>) / dq = exp(<q, k>) k = 0): lambda stays at lambda_init
CONTROL_CONFIG = {"DIFF-lambda0": dict(lambda_init=0.0, lambda_std_dev=0.0),
                  "DIFF-lambda-frozen": dict(lambda_std_dev=0.0),
                  "DIFF-noSubLN": dict(use_subln=False), "DIFF-V2": dict(diff_version=2)}
# the names `--controls` takes
CONTROL_KEYS = {"llama-h": "Llama-h", "2h": "DIFF-2h", "lambda0": "DIFF-lambda0", "nosubln": "DIFF-noSubLN",
                "v2": "DIFF-V2", "plus": "DIFF-plus", "frozen": "DIFF-lambda-frozen"}
# Initialisations offered to both families alike, on top of Hugging Face's Llama init (N(0, 0.02), tied embeddings):
# token embeddings multiplied by sqrt(hidden) in the forward (Gemma; the first author's YOCO code), and the output
# projections of each block (o_proj, down_proj) scaled by 1/sqrt(2 layers) at init (GPT-2, Megatron).
INITS = {"llama": dict(embed_sqrt=False, out_depth=False), "embed-sqrt": dict(embed_sqrt=True, out_depth=False),
         "out-depth": dict(embed_sqrt=False, out_depth=True),
         "embed-sqrt+out-depth": dict(embed_sqrt=True, out_depth=True)}
BASE_INIT = "llama"
PACKAGE_DEFAULT = "embed-sqrt"  # DiffConfig's default for new models: embedding_multiplier = sqrt(hidden_size)


def head_layout(name: str, cfg: dict) -> tuple[str, int, int]:
    """(family, heads, q/k head dim): DIFF has h = H / (2d) heads of dim d and Llama 2h of dim d; the head-count
    controls swap that at the same projection shapes (Llama-h: h heads of dim 2d; DIFF-2h: 2h heads of dim d/2);
    DIFF-lambda0 is DIFF with lambda held at 0, its first branch alone (softmax, values 2d, SubLN); DIFF-noSubLN is
    DIFF without the per-head RMSNorm and its (1 - lambda_init) scale; DIFF-V2 has Llama's 2h heads of dim d for
    keys, values and output, its queries doubled (each head's pair of maps) and a per-token lambda projection;
    DIFF-plus is DIFF with A1 + lambda A2 (`flip_lambda_sign`); DIFF-lambda-frozen is DIFF with lambda fixed at
    lambda_init (zero lambda vectors, which get no gradient)."""
    d = cfg["head_dim"]
    h = cfg["hidden"] // (2 * d)
    return {"DIFF": ("DIFF", h, d), "Llama": ("Llama", 2 * h, d), "Llama-h": ("Llama", h, 2 * d),
            "DIFF-2h": ("DIFF", 2 * h, d // 2), "DIFF-lambda0": ("DIFF", h, d), "DIFF-noSubLN": ("DIFF", h, d),
            "DIFF-V2": ("DIFF", 2 * h, d), "DIFF-plus": ("DIFF", h, d), "DIFF-lambda-frozen": ("DIFF", h, d)}[name]


def build_model(name: str, cfg: dict, seed: int, init: str = BASE_INIT) -> torch.nn.Module:
    """A model of `head_layout(name)` with initialisation `init` (INITS); every projection the same shape, same
    everything else."""
    from transformers import LlamaConfig, LlamaForCausalLM, set_seed

    from diff_transformer import DiffConfig, DiffForCausalLM

    family, heads, head_dim = head_layout(name, cfg)
    shared = dict(vocab_size=256, hidden_size=cfg["hidden"], intermediate_size=cfg["hidden"] * 8 // 3 // 16 * 16,
                  num_hidden_layers=cfg["layers"], max_position_embeddings=cfg["context"], tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    set_seed(seed)
    if family == "DIFF":
        # embeddings unscaled here: `apply_init` scales both families alike
        config = DiffConfig(**shared, num_attention_heads=heads, head_dim=head_dim, embedding_multiplier=1.0,
                            **CONTROL_CONFIG.get(name, {}))
        model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
        if name == "DIFF-plus":
            flip_lambda_sign(model)
    else:
        config = LlamaConfig(**shared, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim)
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return apply_init(model, init)


def flip_lambda_sign(model: torch.nn.Module) -> torch.nn.Module:
    """DIFF-plus: each layer's lambda negated where its attention reads it, so that every head computes
    (A1 + lambda A2) V with DIFF's parameters, initialisation and gradient flow: only the sign differs. A forward hook
    on the benchmark's own model; the package's code is unchanged. Inside `frozen_lambdas` (generate), which stores
    the module's hooked output and then returns it, the stored value passes unchanged."""
    from diff_transformer.diff_lambda import DiffLambda

    for module in model.modules():
        if isinstance(module, DiffLambda):
            module.register_forward_hook(lambda module, args, out: out if module.frozen is not None else -out)
    return model


def apply_init(model: torch.nn.Module, init: str) -> torch.nn.Module:
    """`INITS[init]` on a freshly initialised model of either family, by the same code for both."""
    spec, layers = INITS[init], model.config.num_hidden_layers
    if spec["out_depth"]:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.mul_((2 * layers) ** -0.5)
    return scale_embeddings(model, init)


def scale_embeddings(model: torch.nn.Module, init: str) -> torch.nn.Module:
    """The forward part of `INITS[init]`: with `embed_sqrt`, the token embeddings multiplied by sqrt(hidden) by a
    forward hook. A model saved and loaded again needs it again (its weights carry the rest of the initialisation)."""
    if INITS[init]["embed_sqrt"]:
        scale = math.sqrt(model.config.hidden_size)
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output * scale)
    return model


def parameter_count(name: str, cfg: dict) -> int:
    return sum(p.numel() for p in build_model(name, cfg, 0).parameters())


def eval_steps(steps: int, points: int) -> list[int]:
    """~`points` log-spaced steps from steps/32 to steps (distinct, the last one the end of training)."""
    return sorted({max(1, round(s)) for s in np.geomspace(max(1, steps / 32), steps, points)} | {steps})


def validation_loss(model: torch.nn.Module, val: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model(chunk, labels=chunk).loss.item() for chunk in val.split(16)]
    model.train()
    return float(np.mean(losses))


def train_run(name: str, cfg: dict, lr: float, seed: int, steps: int, train: torch.Tensor, val: torch.Tensor,
              init: str = BASE_INIT, save_to: Path | None = None, nudge: list | None = None) -> dict:
    """One single-epoch run: AdamW (betas 0.9/0.95, weight decay 0.1, clip 1.0), linear warm-up then linear decay to
    0, batches drawn without replacement in the order of `seed`. Returns the curve and the seconds it took; with
    `save_to`, the final model is saved there too (`save_model`). `nudge` [step, size]: after that step every weight
    is multiplied by 1 + size * N(0, 1) (fixed draws), a change of the size of fp32 rounding
    (benchmarks/rounding_sensitivity.py)."""
    from transformers import get_linear_schedule_with_warmup

    model = build_model(name, cfg, seed, init)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, round(cfg["warmup"] * steps)), steps)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[: steps * cfg["batch"]]
    assert len(order) == steps * cfg["batch"], "the corpus is too small for a single epoch of this budget"
    marks, curve, window, start = eval_steps(steps, cfg["points"]), [], [], time.monotonic()
    for step in range(1, steps + 1):
        batch = train[order[(step - 1) * cfg["batch"]: step * cfg["batch"]]]  # [batch, context]
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if nudge is not None and step == nudge[0]:
            nudge_weights(model, nudge[1])
        window.append(loss.item())
        if step in marks:
            curve.append({"step": step, "tokens": step * cfg["batch"] * cfg["context"],
                          "train_loss": float(np.mean(window)), "val_loss": validation_loss(model, val)})
            window = []
            print(f"  {name} ({init}) lr {lr:g} seed {seed}: {curve[-1]} ({time.monotonic() - start:.0f} s)",
                  flush=True)
    if save_to is not None:
        save_model(model, init, save_to)
    return {"curve": curve, "seconds": round(time.monotonic() - start, 1)}


def nudge_weights(model: torch.nn.Module, size: float) -> None:
    """Every weight w becomes w * (1 + size * z), z ~ N(0, 1) from a generator of its own (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + size * torch.randn(param.shape, generator=generator))


def save_model(model: torch.nn.Module, init: str, folder: Path) -> None:
    """`model` as a `from_pretrained` folder that computes what it computed here, written whole or not at all. The
    forward part of `embed-sqrt` (a hook) becomes DIFF's `embedding_multiplier`; Llama has no such field, so a Llama
    of that initialisation cannot be saved as a plain folder (nor DIFF-plus, whose sign flip is a hook)."""
    from diff_transformer.tools.safe_write import staged_folder

    config = model.config
    if INITS[init]["embed_sqrt"]:
        if not hasattr(config, "embedding_multiplier"):
            raise ValueError(f"{type(model).__name__} has no embedding_multiplier: a model of initialisation {init} "
                             "cannot be saved")
        config = copy.deepcopy(config)  # the live model keeps its hook and its own config
        config.embedding_multiplier = math.sqrt(config.hidden_size)
    with staged_folder(folder, replace=True) as staged:
        model.save_pretrained(staged)
        config.save_pretrained(staged)  # the saved multiplier in place of the live model's 1.0


def write_json(path: Path, value: dict) -> None:
    """Written whole or not at all (the package's one way of writing a file)."""
    from diff_transformer.tools.safe_write import write_text

    write_text(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


def run_path(out: Path, settings: dict) -> Path:
    """Where the run of `settings` is stored: OUTPUT_DIR/runs/<model>-<hash of the settings>.json."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return out / "runs" / f"{settings['model']}-{key}.json"


def stored_run(out: Path, settings: dict) -> dict | None:
    """The stored run of `settings`, None when it has not been trained."""
    path = run_path(out, settings)
    return json.loads(path.read_text()) if path.is_file() else None


def cached_run(out: Path, settings: dict, compute) -> dict:
    """A run stored under the hash of its settings (which hold the corpus hash), computed and stored when missing."""
    path = run_path(out, settings)
    if path.is_file():
        return json.loads(path.read_text())
    run = {"settings": settings, **compute()}
    write_json(path, run)
    return run


# -------------------------------------------------------------------------------------------------------- analysis
def fit_power_law(tokens: np.ndarray, loss: np.ndarray) -> dict:
    """Least squares L(T) = E + A T^-alpha (E >= 0, A >= 0): for each alpha, E and A are a linear least-squares problem;
    alpha on a log grid, then refined by golden-section search around the best grid point. T in millions."""
    x, y = np.asarray(tokens, dtype=float) / 1e6, np.asarray(loss, dtype=float)

    def solve(alpha: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Closed-form simple regression of y on z = x^-alpha, for each alpha: (sse, E, A), A clipped at 0."""
        z = x[None, :] ** -np.atleast_1d(alpha)[:, None]  # [alphas, points]
        zc = z - z.mean(axis=1, keepdims=True)
        a = np.maximum((zc * (y - y.mean())).sum(axis=1) / (zc ** 2).sum(axis=1), 0.0)
        e = y.mean() - a * z.mean(axis=1)
        floor = e < 0  # a loss has no negative floor: there, the best fit with E = 0
        a = np.where(floor, np.maximum((z * y).sum(axis=1) / (z ** 2).sum(axis=1), 0.0), a)
        e = np.where(floor, 0.0, e)
        return ((e[:, None] + a[:, None] * z - y) ** 2).sum(axis=1), e, a

    grid = np.geomspace(1e-3, 4.0, 400)
    best = int(np.argmin(solve(grid)[0]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        m1, m2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if solve(m1)[0][0] < solve(m2)[0][0]:
            hi = m2
        else:
            lo = m1
    alpha = (lo + hi) / 2
    sse, e, a = (float(v[0]) for v in solve(alpha))
    return {"E": e, "A": a, "alpha": float(alpha), "rmse": math.sqrt(sse / len(x))}


def fitted_loss(fit: dict, tokens: float) -> float:
    return fit["E"] + fit["A"] * (tokens / 1e6) ** -fit["alpha"]


def tokens_for_loss(fit: dict, loss: float) -> float:
    """Tokens at which the fitted curve reaches `loss`; inf when it never does (loss <= E)."""
    if loss <= fit["E"] or fit["A"] <= 0:
        return math.inf
    return 1e6 * (fit["A"] / (loss - fit["E"])) ** (1 / fit["alpha"])


def mean_curve(curves: list[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([p["tokens"] for p in curves[0]], dtype=float)
    return tokens, np.mean([[p[key] for p in c] for c in curves], axis=0)


def token_ratio(curves: dict, skip: int) -> dict:
    """Fits of both models' mean validation curves (points after the first `skip`) and the ratio: tokens DIFF needs
    to reach Llama's fitted loss at Llama's last point, over that token count; and its inverse framing: tokens Llama
    needs to reach DIFF's final fitted loss, over the same count."""
    fits = {m: fit_power_law(*(a[skip:] for a in mean_curve(curves[m], "val_loss"))) for m in MODELS}
    end = curves["Llama"][0][-1]["tokens"]
    return {"fits": fits,
            "diff_over_llama": tokens_for_loss(fits["DIFF"], fitted_loss(fits["Llama"], end)) / end,
            "llama_over_diff": tokens_for_loss(fits["Llama"], fitted_loss(fits["DIFF"], end)) / end}


def interpolated_ratio(curves: dict) -> float | None:
    """Without a fit: where DIFF's mean validation curve (linear in log T) crosses Llama's mean final loss, over the
    final token count; None when it does not within the measured range."""
    tokens, diff = mean_curve(curves["DIFF"], "val_loss")
    target = mean_curve(curves["Llama"], "val_loss")[1][-1]
    for i in range(len(tokens)):
        if diff[i] <= target:
            if i == 0:
                return None
            f = (diff[i - 1] - target) / (diff[i - 1] - diff[i])
            return float(np.exp(np.log(tokens[i - 1]) + f * (np.log(tokens[i]) - np.log(tokens[i - 1]))) / tokens[-1])
    return None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, inf counted as the largest values (np.percentile would give nan)."""
    ordered = sorted(values)
    index = q / 100 * (len(ordered) - 1)
    lo, hi = ordered[math.floor(index)], ordered[math.ceil(index)]
    return lo if lo == hi or math.isinf(hi) else lo + (hi - lo) * (index - math.floor(index))


def analyse(curves: dict, skip: int, samples: int = BOOTSTRAP, seed: int = 0) -> dict:
    """`curves`: {model: [curve per seed]}, seeds paired by position. Point estimates, bootstrap 90% intervals over
    seeds (the same resampled seeds for both models) and the per-seed final validation-loss gaps."""
    point = token_ratio(curves, skip)
    rng = np.random.default_rng(seed)
    n = len(curves["DIFF"])
    boot, memo = {"diff_over_llama": [], "llama_over_diff": []}, {}
    for _ in range(samples):
        pick = tuple(sorted(rng.integers(0, n, n).tolist()))  # the mean curves depend on the multiset only
        if pick not in memo:
            memo[pick] = token_ratio({m: [curves[m][i] for i in pick] for m in MODELS}, skip)
        result = memo[pick]
        for key in boot:
            boot[key].append(result[key])
    finals = {m: [c[-1]["val_loss"] for c in curves[m]] for m in MODELS}
    return {
        "fits": point["fits"],
        "ratio": {key: {"estimate": point[key], "p05": percentile(boot[key], 5), "p95": percentile(boot[key], 95),
                        "infinite_share": sum(map(math.isinf, boot[key])) / samples} for key in boot},
        "interpolated_ratio": interpolated_ratio(curves),
        "final": {m: spread(finals[m]) for m in MODELS},
        "gap": paired(finals["DIFF"], finals["Llama"]),
    }


def spread(values: list[float]) -> dict:
    """Per seed, mean and sd (0 for one value)."""
    sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return {"per_seed": list(values), "mean": float(np.mean(values)), "sd": sd}


def paired(a: list[float], b: list[float]) -> dict:
    """a - b seed by seed: per seed, mean, sd and the 90% t interval of the mean."""
    gaps = [x - y for x, y in zip(a, b, strict=True)]
    return {**spread(gaps), "t90": t_interval(gaps)}


T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}  # t_0.95 by dof


def t_interval(values: list[float]) -> list[float] | None:
    """The two-sided 90% Student-t interval of the mean (None for a single value)."""
    if len(values) < 2:
        return None
    half = T95.get(len(values) - 1, 1.645) * float(np.std(values, ddof=1)) / math.sqrt(len(values))
    return [float(np.mean(values)) - half, float(np.mean(values)) + half]


# ---------------------------------------------------------------------------------------------------------- report
def fmt_ratio(value: float) -> str:
    return "never (beyond the fit's floor)" if math.isinf(value) else f"{value:.2f}"


def verdict(covers: bool, diff_better: bool, better: str, worse: str) -> str:
    """What an interval says: nothing (it covers no-difference), or which way."""
    if covers:
        return "no difference detectable at this scale"
    return better if diff_better else worse


def paired_gap(a: list[float], b: list[float]) -> str:
    """a - b per seed: mean +- sd and the 90% t interval of the mean."""
    gap = paired(a, b)
    low, high = gap["t90"] or [math.nan, math.nan]
    return f"{gap['mean']:+.4f} +- {gap['sd']:.4f} [{low:+.4f}, {high:+.4f}]"


def seed_finals(seeds: dict, cfg: dict) -> list[float]:
    return [seeds[str(s)]["curve"][-1]["val_loss"] for s in cfg["seeds"]]


def final_losses(results: dict, init: str | None = None) -> dict[str, list[float]]:
    """{model: final validation loss per seed, in seed order}: DIFF and Llama at `init` (None: each at its best
    initialisation, the headline runs), and every stored control (all at the chosen initialisation)."""
    cfg, runs = results["config"], results["runs"]
    main = runs["main"] if init is None else {m: results["studies"]["inits"][init][m]["seeds"] for m in MODELS}
    stored = {**main, **runs.get("controls", {})}
    return {m: seed_finals(seeds, cfg) for m, seeds in stored.items()}


def gap_verdict(a: list[float], b: list[float], names: tuple[str, str]) -> str:
    """What the 90% interval of a - b says, in words."""
    low, high = paired(a, b)["t90"]
    if low <= 0 <= high:
        return "interval covers 0"
    return f"{names[0]} lower" if high < 0 else f"{names[0]} higher"


def init_lines(results: dict) -> list[str]:
    """The initialisation study: every variant for both families, each with its swept learning rate."""
    cfg, stored = results["config"], results["studies"]["inits"]
    study = {init: stored[init] for init in INITS if init in stored}
    lines = ["", "## Initialisation", "",
             "Both families start from Hugging Face's Llama initialisation (N(0, 0.02), tied embeddings) and get the "
             "same options on top: `embed-sqrt` multiplies the token embeddings by sqrt(hidden) in the forward "
             "(Gemma; the first author's YOCO code; DIFF's `embedding_multiplier`), `out-depth` scales each block's "
             "output projections (o_proj, down_proj) by 1/sqrt(2 layers) at init (GPT-2, Megatron). Each variant has "
             "its own learning-rate sweep (same grid and budget as above) for each family, then every seed:", "",
             "| initialisation | model | LR | final val loss per seed | mean +- sd | DIFF - Llama [90% t interval] |",
             "|---|---|---|---|---|---|"]
    for init in study:
        finals = {m: seed_finals(study[init][m]["seeds"], cfg) for m in MODELS}
        for m in MODELS:
            gap = (f"{paired_gap(finals['DIFF'], finals['Llama'])}: "
                   f"{gap_verdict(finals['DIFF'], finals['Llama'], ('DIFF', 'Llama'))}" if m == "DIFF" else "")
            lines.append(f"| {init} | {m} | {study[init][m]['lr']:g} | " + ", ".join(f"{v:.4f}" for v in finals[m])
                         + " | {mean:.4f} +- {sd:.4f} | ".format(**spread(finals[m])) + gap + " |")
    base = {m: seed_finals(study[BASE_INIT][m]["seeds"], cfg) for m in MODELS}
    lines += ["", f"Each family against itself at `{BASE_INIT}` (paired by seed, [90% t interval]):", ""]
    for init in (i for i in study if i != BASE_INIT):
        cells = [f"{m} {paired_gap(seed_finals(study[init][m]['seeds'], cfg), base[m])}" for m in MODELS]
        lines.append(f"- {init}: " + "; ".join(cells))
    chosen, best = results["chosen_init"], results["best_init"]
    default = (f"the package's default for new models (`DiffConfig().embedding_multiplier` = sqrt(hidden)) is "
               f"`{PACKAGE_DEFAULT}`" + (", the same" if chosen == PACKAGE_DEFAULT else ", not the same"))
    where = ("where the controls below run" if results["studies"].get("controls") else
             "where the controls run (not in this results.json: `--without-controls`)")
    lines += ["", f"DIFF's lowest mean final loss is at `{chosen}`, {where}; {default}. Each "
              "family's best: " + ", ".join(f"{m} `{best[m]}`" for m in MODELS)
              + "; the result above compares each at its best.", "",
              "Learning-rate sweeps (final validation loss after the sweep budget, seed 0):", "",
              "| LR | " + " | ".join(f"{m} {i}" for i in study for m in MODELS) + " |",
              "|---|" + "---|" * (len(study) * len(MODELS))]
    for lr in cfg["lrs"]:
        lines.append(f"| {lr:g} | " + " | ".join(f"{study[i][m]['sweep'][f'{lr:g}']['curve'][-1]['val_loss']:.4f}"
                                                 for i in study for m in MODELS) + " |")
    edges = [f"{m} {i}" for i in study for m in MODELS if study[i][m]["lr"] in (min(cfg["lrs"]), max(cfg["lrs"]))]
    if edges:
        lines += ["", f"The best learning rate is at the edge of the grid for {', '.join(edges)}."]
    return lines


CONTROL_PAIRS = (("DIFF", "Llama-h", "both with h heads"), ("DIFF-2h", "Llama", "both with 2h heads"),
                 ("Llama-h", "Llama", "Llama, h heads against 2h"), ("DIFF-2h", "DIFF", "DIFF, 2h heads against h"),
                 ("DIFF", "DIFF-lambda0", "lambda learned against held at 0: the second branch disabled"),
                 ("DIFF", "DIFF-plus", "A1 - lambda A2 against A1 + lambda A2: the sign alone"),
                 ("DIFF", "DIFF-lambda-frozen", "lambda learned against fixed at lambda_init"),
                 ("DIFF", "DIFF-noSubLN", "SubLN against none"), ("DIFF-noSubLN", "Llama-h", "both with h heads"),
                 ("DIFF-V2", "DIFF", "DIFF V2 against V1"), ("DIFF-V2", "Llama", "DIFF V2 against Llama"))


# What each control changes, for the report (shown for the controls a results.json holds).
CONTROL_TEXT = {
    "Llama-h": "DIFF has half Llama's attention maps (h differential heads against 2h heads): Llama-h and DIFF-2h "
               "give each model the other's head count at the same projection shapes.",
    "DIFF-lambda0": "DIFF-lambda0 holds lambda at 0 (lambda_init 0 and zero lambda vectors, which get no gradient): "
                    "its second branch disabled, so that branch's queries and keys get no gradient either; it does "
                    "not isolate the subtraction.",
    "DIFF-noSubLN": "DIFF-noSubLN drops the per-head RMSNorm and its (1 - lambda_init) scale.",
    "DIFF-V2": "DIFF-V2 (`diff_version=2`, no SubLN by design) has Llama's 2h heads for keys, values and output and "
               "twice its query rows.",
    "DIFF-plus": "DIFF-plus computes A1 + lambda A2 with DIFF's parameters, initialisation and gradient flow: only "
                 "the sign differs.",
    "DIFF-lambda-frozen": "DIFF-lambda-frozen fixes lambda at lambda_init (zero lambda vectors): it differs from DIFF "
                          "in the gradient of its 4 lambda vectors per layer only (they get none).",
}


def control_lines(results: dict) -> list[str]:
    """The controls, on the chosen initialisation, each with its own swept learning rate; paired by seed with DIFF
    and Llama at that initialisation."""
    cfg, chosen = results["config"], results["chosen_init"]
    finals = final_losses(results, chosen)
    names = [m for m in CONTROLS if m in finals]
    if not names:
        return []
    lrs = {m: results["studies"]["inits"][chosen][m]["lr"] for m in MODELS}
    lrs |= {m: results["studies"]["controls"][m]["lr"] for m in names}
    lines = ["", f"## Controls, on `{chosen}`", "",
             " ".join(text for m, text in CONTROL_TEXT.items() if m in names) + " Each control has its own "
             "learning-rate sweep:", "",
             "| model | heads x q/k dim | parameters | LR | final val loss per seed | mean +- sd |",
             "|---|---|---|---|---|---|"]
    for m in (*MODELS, *names):
        _, heads, dim = head_layout(m, cfg)
        lines.append(f"| {m} | {heads} x {dim} | {results['parameters'][m]:,} | {lrs[m]:g} | "
                     + ", ".join(f"{v:.4f}" for v in finals[m])
                     + " | {mean:.4f} +- {sd:.4f} |".format(**spread(finals[m])))
    lines += ["", "Paired differences of the final validation loss (mean +- sd over seeds [90% t interval]):", ""]
    lines += [f"- {a} - {b} ({what}): {paired_gap(finals[a], finals[b])}: {gap_verdict(finals[a], finals[b], (a, b))}"
              for a, b, what in CONTROL_PAIRS if a in finals and b in finals]
    return lines


def render(results: dict) -> str:
    """report.md, a pure function of results.json."""
    cfg, corpus, runs = results["config"], results["corpus"], results["runs"]
    curves = {m: [runs["main"][m][str(s)]["curve"] for s in cfg["seeds"]] for m in MODELS}
    stats = analyse(curves, results["fit_skip"])
    tokens = curves["DIFF"][0][-1]["tokens"]
    h = cfg["hidden"] // (2 * cfg["head_dim"])
    lines = [
        "# Single-epoch language modelling: DIFF against Llama at equal parameters",
        "",
        f"Generated by `{results['command']}` "
        "(`--from-saved` rewrites this file from results.json).",
        "",
        f"Corpus: {corpus['name']} {corpus['version']} source release from PyPI ({corpus['license']}), docs/**/*.txt "
        f"and django/**/*.py, {corpus['bytes']:,} byte tokens (content sha256 `{corpus['content_sha256'][:16]}...`). "
        f"Each run trains on {tokens:,} tokens ({cfg['steps']} steps of {cfg['batch']} x {cfg['context']}), "
        "none seen twice; validation on a fixed held-out set of "
        f"{cfg['val_blocks'] * cfg['context']:,} tokens.",
        "",
        f"Models: hidden {cfg['hidden']}, {cfg['layers']} layers, MLP {cfg['hidden'] * 8 // 3 // 16 * 16}, "
        f"vocabulary 256 (bytes), tied embeddings. DIFF: {h} differential heads (q/k dim {cfg['head_dim']}, values "
        f"{2 * cfg['head_dim']}); Llama: {2 * h} heads of dim {cfg['head_dim']}. AdamW (0.9, 0.95), weight decay 0.1, "
        f"linear warm-up over {cfg['warmup']:.0%} of the steps then linear decay to 0; seeds {cfg['seeds']} paired "
        "(same initialisation seed and batch order per seed).",
        "",
        f"Learning rate: picked per model and initialisation by final validation loss after "
        f"{cfg['sweep_fraction']:.0%} of the budget, seed 0, from {', '.join(f'{lr:g}' for lr in cfg['lrs'])}.",
    ]
    lines += ["", "## Result: each family at its best initialisation", "",
              "| | parameters | initialisation | LR | final val loss per seed | mean +- sd | fit E + A (T/1M)^-alpha |",
              "|---|---|---|---|---|---|---|"]
    for m in MODELS:
        fit, final = stats["fits"][m], stats["final"][m]
        lines.append(f"| {m} | {results['parameters'][m]:,} | {results['best_init'][m]} | {results['lr'][m]:g} | "
                     + ", ".join(f"{v:.4f}" for v in final["per_seed"])
                     + f" | {final['mean']:.4f} +- {final['sd']:.4f} | "
                       f"{fit['E']:.3f} + {fit['A']:.3f} (T/1M)^-{fit['alpha']:.3f} (rmse {fit['rmse']:.4f}) |")
    gap, ratio, inverse = stats["gap"], stats["ratio"]["diff_over_llama"], stats["ratio"]["llama_over_diff"]
    gap_says = verdict(gap["t90"][0] < 0 < gap["t90"][1], gap["mean"] < 0, "DIFF lower", "DIFF higher") \
        if gap["t90"] else ""
    ratio_says = verdict(ratio["p05"] < 1 < ratio["p95"], ratio["estimate"] < 1, "DIFF needs fewer tokens",
                         "DIFF needs more tokens")
    interp = stats["interpolated_ratio"]
    lines += [
        "",
        f"- Final validation-loss gap DIFF - Llama per seed: {', '.join(f'{g:+.4f}' for g in gap['per_seed'])}; "
        f"mean {gap['mean']:+.4f} +- {gap['sd']:.4f} (sd over {len(gap['per_seed'])} paired seeds) nats"
        + (f", 90% t interval of the mean [{gap['t90'][0]:+.4f}, {gap['t90'][1]:+.4f}]: {gap_says}"
           if gap["t90"] else "") + ".",
        f"- Token ratio at matched loss (tokens DIFF needs to reach Llama's fitted loss at {tokens:,} tokens, over "
        f"{tokens:,}): {fmt_ratio(ratio['estimate'])}, 90% bootstrap interval over seeds "
        f"[{fmt_ratio(ratio['p05'])}, {fmt_ratio(ratio['p95'])}]: "
        f"{ratio_says} (paper, 3B models: ~{PAPER_RATIO}).",
        f"- The other way round (tokens Llama needs to reach DIFF's fitted final loss, over {tokens:,}): "
        f"{fmt_ratio(inverse['estimate'])}, 90% interval [{fmt_ratio(inverse['p05'])}, {fmt_ratio(inverse['p95'])}] "
        f"(paper: ~{1 / PAPER_RATIO:.2f}).",
        "- Without a fit (DIFF's mean curve, interpolated in log T, crossing Llama's mean final loss): "
        + (f"{interp:.2f}." if interp is not None else "no crossing within the measured range."),
        "- Wall time per run, one thread each, evaluations included (runs shared the machine's cores with other work, "
        "so read these as rough): "
        + ", ".join(f"{m} {np.mean([runs['main'][m][str(s)]['seconds'] for s in cfg['seeds']]):.0f} s" for m in MODELS)
        + ".",
        *init_lines(results),
        *control_lines(results),
        "",
        "## Validation loss along training (mean over seeds)",
        "",
        "| tokens | " + " | ".join(f"{m} val | {m} train" for m in MODELS) + " | gap (val) |",
        "|---|" + "---|---|" * len(MODELS) + "---|",
    ]
    means = {m: {k: mean_curve(curves[m], k)[1] for k in ("val_loss", "train_loss")} for m in MODELS}
    for i, p in enumerate(curves["DIFF"][0]):
        cells = [f"{means[m]['val_loss'][i]:.4f} | {means[m]['train_loss'][i]:.4f}" for m in MODELS]
        lines.append(f"| {p['tokens']:,} | " + " | ".join(cells)
                     + f" | {means['DIFF']['val_loss'][i] - means['Llama']['val_loss'][i]:+.4f} |")
    lines += [
        "",
        "## Reading",
        "",
        f"- Scale: {results['parameters']['DIFF']:,} parameters and {tokens:,} tokens per run, on one CPU core; the "
        "paper's Figure 3 is at 830M-13B parameters and up to 360B tokens. An independent MLX replication at 30M "
        "parameters / 100M tokens found DIFF - baseline = -0.016 +- 0.023 nats over 4 paired seeds.",
        f"- The fit uses the mean validation curve after the warm-up (its first {results['fit_skip']} points "
        "dropped); the points "
        "are along single runs whose learning rate decays linearly to the end, not separate runs per token count, "
        "so the last point includes the annealing drop. The ratio beyond the measured range is an extrapolation of "
        "the fit.",
        *[f"- {m}'s fitted floor E is at its bound 0: no floor shows within the measured range, the fit is a pure "
          "power law there." for m in MODELS if stats["fits"][m]["E"] == 0.0],
        *([f"- A ratio of {ratio['estimate']:.2f} lies beyond the measured range (DIFF's curve extrapolated to "
           f"{ratio['estimate']:.1f} times the tokens of a run): read it as the direction and rough size only."]
          if ratio["estimate"] > 1.0 else []),
        f"- The bootstrap resamples {len(gap['per_seed'])} seed pairs ({BOOTSTRAP} draws): with so few seeds the "
        "interval is coarse and, if anything, too narrow.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, color in zip(MODELS, ("tab:red", "tab:blue")):
        curves = [results["runs"]["main"][m][str(s)]["curve"] for s in cfg["seeds"]]
        for c in curves:
            ax.plot([p["tokens"] for p in c], [p["val_loss"] for p in c], color=color, alpha=0.3, lw=0.8)
        tokens, mean = mean_curve(curves, "val_loss")
        ax.plot(tokens, mean, "o", color=color, label=f"{m} ({results['parameters'][m]:,} params), mean")
        fit = fit_power_law(tokens[results["fit_skip"]:], mean[results["fit_skip"]:])
        grid = np.geomspace(tokens[results["fit_skip"]], tokens[-1], 100)
        ax.plot(grid, [fitted_loss(fit, t) for t in grid], "--", color=color, lw=1,
                label=f"fit {fit['E']:.2f} + {fit['A']:.2f} (T/1M)^-{fit['alpha']:.2f}")
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.legend()
    fig.tight_layout()
    from diff_transformer.tools.safe_write import write_file

    write_file(path, lambda staged: fig.savefig(staged, dpi=110))
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------- main
WORKER: dict = {}  # a pool worker's config and data blocks


def load_blocks(cfg: dict, corpus_dir: Path, fetch: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(corpus description, train blocks, validation blocks) of the pinned corpus."""
    data = corpus_bytes(corpus_archive(corpus_dir, fetch=fetch))
    if hashlib.sha256(data).hexdigest() != CORPUS["content_sha256"]:
        sys.exit("the extracted corpus differs from the pinned one (content sha256): extraction is not reproducible")
    corpus = {k: CORPUS[k] for k in ("name", "version", "file", "sha256", "license")}
    corpus |= {"bytes": len(data), "content_sha256": hashlib.sha256(data).hexdigest()}
    return corpus, *blocks(data, cfg["context"], cfg["val_blocks"])


def die_with_parent() -> None:
    """End this worker process when the one that started it ends (Linux: PR_SET_PDEATHSIG), so that a study stopped
    by a signal (which skips the pool's own shutdown) leaves no worker training on, racing a restarted study for the
    same run files."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import multiprocessing
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the parent ended before the call
        os.kill(os.getpid(), signal.SIGKILL)


def start_worker(cfg: dict, corpus_dir: Path, threads: int) -> None:
    die_with_parent()
    torch.set_num_threads(threads)
    _, train, val = load_blocks(cfg, corpus_dir, fetch=False)
    WORKER.update(cfg=cfg, train=train, val=val)


def worker_run(job: tuple[Path, dict]) -> dict:
    out, settings = job
    cfg, train, val = WORKER["cfg"], WORKER["train"], WORKER["val"]
    return cached_run(out, settings, lambda: train_run(
        settings["model"], cfg, settings["lr"], settings["seed"], settings["steps"], train, val,
        settings.get("init", BASE_INIT), nudge=settings.get("nudge")))


def stored_runs(node: object) -> list[dict]:
    """Every run (a dict with "settings" and "curve") anywhere in a results tree."""
    if isinstance(node, dict) and "settings" in node and "curve" in node:
        return [node]
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [run for value in values for run in stored_runs(value)]


def import_stored_runs(out: Path) -> None:
    """Every run a previous results.json in `out` holds goes into the run store (a clone has no runs/ folder), so
    that runs of unchanged settings are not trained again."""
    path = out / "results.json"
    if path.is_file():
        for run in stored_runs(json.loads(path.read_text())):
            cached_run(out, run["settings"], lambda run=run: {k: v for k, v in run.items() if k != "settings"})


def best_lr(cfg: dict, sweep: dict) -> float:
    return min(cfg["lrs"], key=lambda x: sweep[f"{x:g}"]["curve"][-1]["val_loss"])


def mean_final(seeds: dict) -> float:
    return float(np.mean([run["curve"][-1]["val_loss"] for run in seeds.values()]))


def unreported_runs(out: Path, results: dict) -> list[dict]:
    """Finished runs in the store that `results` does not report (controls of a run stopped before them), kept in
    results.json so that a clone resumes from them."""
    key = lambda run: json.dumps(run["settings"], sort_keys=True)
    reported = {key(run) for run in stored_runs({k: v for k, v in results.items() if k != "unreported_runs"})}
    stored = [json.loads(path.read_text()) for path in sorted((out / "runs").glob("*.json"))]
    return [run for run in stored if key(run) not in reported]


def run_all(cfg: dict, out: Path, corpus_dir: Path, quick: bool, jobs: int, threads: int,
            with_controls: bool = True, train_controls: tuple[str, ...] = CONTROLS) -> dict:
    """Every initialisation for both families (each with its own learning-rate sweep, then every seed); the
    initialisation with DIFF's lowest mean final loss is the chosen one; the `train_controls` run on it, each with its
    own sweep, and the other controls are reported where every run of theirs is stored already (none is trained). Runs
    go to `jobs` worker processes of `threads` threads each, in phases (sweeps, then the seeds)."""
    corpus, _, _ = load_blocks(cfg, corpus_dir, fetch=True)
    print(f"corpus: {corpus['bytes']:,} byte tokens", flush=True)
    model_cfg = {k: cfg[k] for k in ("hidden", "layers", "head_dim", "context", "batch", "points", "val_blocks",
                                     "warmup")}
    import_stored_runs(out)

    def settings(name: str, init: str, lr: float, seed: int, steps: int) -> dict:
        extra = {} if init == BASE_INIT else {"init": init}  # runs of the base init keep their earlier keys
        return {"model": name, "lr": lr, "seed": seed, "steps": steps, **model_cfg, **extra,
                "corpus": corpus["content_sha256"]}

    context = __import__("multiprocessing").get_context("spawn")
    pool = context.Pool(jobs, start_worker, (cfg, corpus_dir, threads)) if jobs > 1 else None
    if pool is None:
        start_worker(cfg, corpus_dir, threads)

    def many(specs: list[tuple]) -> list[dict]:
        work = [(out, settings(*spec)) for spec in specs]
        return pool.map(worker_run, work, chunksize=1) if pool else [worker_run(job) for job in work]

    def stored(specs: list[tuple]) -> list[dict | None]:
        return [stored_run(out, settings(*spec)) for spec in specs]

    sweep_steps = max(2, round(cfg["steps"] * cfg["sweep_fraction"]))

    def study(names: list[str], inits: list[str], runs=many) -> dict:
        """{init: {name: {"lr", "sweep": {lr: run}, "seeds": {seed: run}}}}: a sweep, then every seed at its best.
        `runs` gives the runs of specs (`many` trains the missing ones, `stored` gives None for them)."""
        pairs = [(init, m) for init in inits for m in names]
        specs = [(m, init, lr, 0, sweep_steps) for init, m in pairs for lr in cfg["lrs"]]
        done = iter(runs(specs))
        found = {init: {m: {"sweep": {f"{lr:g}": next(done) for lr in cfg["lrs"]}} for m in names} for init in inits}
        for init, m in pairs:
            found[init][m]["lr"] = best_lr(cfg, found[init][m]["sweep"])
        specs = [(m, init, found[init][m]["lr"], s, cfg["steps"]) for init, m in pairs for s in cfg["seeds"]]
        done = iter(runs(specs))
        for init, m in pairs:
            found[init][m]["seeds"] = {str(s): next(done) for s in cfg["seeds"]}
        print("learning rates: " + ", ".join(f"{m} ({i}) {found[i][m]['lr']:g}" for i, m in pairs), flush=True)
        return found

    def stored_study(name: str, init: str) -> dict | None:
        """A control's study from stored runs alone; None when one of its runs is missing."""
        if None in stored([(name, init, lr, 0, sweep_steps) for lr in cfg["lrs"]]):
            return None
        entry = study([name], [init], runs=stored)[init][name]
        return None if None in entry["seeds"].values() else entry

    try:
        inits = study(list(MODELS), list(INITS))
        chosen = min(INITS, key=lambda init: mean_final(inits[init]["DIFF"]["seeds"]))
        best = {m: min(INITS, key=lambda init: mean_final(inits[init][m]["seeds"])) for m in MODELS}
        print(f"chosen initialisation (DIFF's lowest mean final loss): {chosen}; per family: {best}", flush=True)
        found = {}
        if with_controls:
            found = study([m for m in CONTROLS if m in train_controls], [chosen])[chosen]
            found |= {m: entry for m in CONTROLS if m not in found and (entry := stored_study(m, chosen))}
        controls = {m: found[m] for m in CONTROLS if m in found}
    finally:
        if pool:
            pool.close()
            pool.join()
    skip = sum(s <= round(cfg["warmup"] * cfg["steps"]) for s in eval_steps(cfg["steps"], cfg["points"]))
    return {"config": cfg, "corpus": corpus, "quick": quick, "fit_skip": skip, "chosen_init": chosen,
            "best_init": best, "lr": {m: inits[best[m]][m]["lr"] for m in MODELS},
            "parameters": {m: parameter_count(m, cfg) for m in MODELS + tuple(controls)},
            "runs": {"main": {m: inits[best[m]][m]["seeds"] for m in MODELS},
                     "controls": {m: controls[m]["seeds"] for m in controls}},
            "studies": {"inits": inits, "controls": controls}}


def control_names(value: str) -> tuple[str, ...]:
    """`--controls plus,frozen` -> ("DIFF-plus", "DIFF-lambda-frozen"); an unknown name is refused."""
    keys = [key.strip().lower() for key in value.split(",") if key.strip()]
    if unknown := [key for key in keys if key not in CONTROL_KEYS]:
        raise argparse.ArgumentTypeError(f"unknown control {', '.join(unknown)}: give some of "
                                         + ", ".join(CONTROL_KEYS))
    return tuple(CONTROL_KEYS[key] for key in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=None,
                        help=f"default {DEFAULT_DIR} (quick: /tmp/lm_scaling_quick)")
    parser.add_argument("--corpus-dir", type=Path, default=Path.home() / ".cache" / "diff-transformer" / "corpus",
                        help="where the release archive is (fetched there with pip when missing)")
    parser.add_argument("--quick", action="store_true", help="toy sizes, about a minute")
    parser.add_argument("--from-saved", action="store_true", help="rewrite report.md from results.json, no training")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
    parser.add_argument("--without-controls", action="store_true",
                        help="the initialisation study and the result only (the controls take about as long again)")
    parser.add_argument("--controls", type=control_names, default=CONTROLS, metavar="NAME,...",
                        help="train only these controls (" + ", ".join(CONTROL_KEYS) + "); the others are reported "
                        "where all their runs are stored. Default: all")
    parser.add_argument("--steps", type=int, default=None, help="training steps per main run (overrides the default)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="paired seeds (default 0 1 2 3)")
    args = parser.parse_args()
    out = args.output_dir or (Path("/tmp/lm_scaling_quick") if args.quick else DEFAULT_DIR)
    if args.from_saved:
        path = out / "results.json"
        if not path.is_file():
            sys.exit(f"no {path}; run `python benchmarks/lm_scaling.py` first (or give --output-dir)")
        results = json.loads(path.read_text())
        plot(results, out / "loss.png")
    else:
        cfg = dict(QUICK if args.quick else FULL)
        if args.steps:
            cfg["steps"] = args.steps
        if args.seeds:
            cfg["seeds"] = args.seeds
        results = run_all(cfg, out, args.corpus_dir, args.quick, args.jobs, args.threads, not args.without_controls,
                          args.controls)
        results["unreported_runs"] = unreported_runs(out, results)
        results["command"] = shlex.join(["python", "benchmarks/lm_scaling.py", *sys.argv[1:]])
        write_json(out / "results.json", results)
        plot(results, out / "loss.png")
    from diff_transformer.tools.safe_write import write_text

    report = render(results)
    write_text(out / "report.md", report)
    print(report)


if __name__ == "__main__":
    main()
