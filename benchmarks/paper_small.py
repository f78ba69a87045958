"""Small-scale reproduction of the Differential Transformer paper (Ye et al., arXiv 2410.05258): DIFF, transformers'
DiffLlama and a Llama Transformer at equal parameter count, trained on identical data in identical batch order with
the same seeds, reported as mean and spread over seeds.

1. Multi-needle retrieval (paper §3.4, scaled down): a haystack of filler sentences with N needles "The magic number
   of <city> is <number>.", then R questions, each followed by its answer, trained as language modelling; greedy
   accuracy on held-out prompts at five depths, along training and at the end.
2. Attention to the answer and attention noise (paper Table 3) at the answering position of the trained retrieval
   models, from the differential map A1 - lambda A2 of both differential models and the softmax map of Llama:
   normalised (each head's row over its sum 1 - lambda, the paper's comparison), raw and the share.
3. Validation loss curves on a text file (tiny Shakespeare by default; skipped when missing), over seeds and in one
   run several times longer, to show whether the gap to Llama closes or flips.
4. §3.8: activation outliers (attention logits with both branches pooled, and per branch; hidden states) and fake
   quantization of attention logits (the paper's Figure 8) and of activations (this project's extension).

    python benchmarks/paper_small.py --calibrate     # Llama alone per --calibrate-needles: choose the setting
    python benchmarks/paper_small.py                 # every experiment (--tasks retrieval / text: one of them)
    python benchmarks/paper_small.py --tasks retrieval --from-saved  # recompute the report from the stored models
    python benchmarks/paper_small.py --quick         # the same pipeline at toy size, in about a minute
    python benchmarks/paper_small.py --device cuda --hidden 256 --layers 6 ...  # scaled up on a GPU
    python benchmarks/paper_small.py --study --jobs 2  # every family at every initialisation, own LR sweeps
    python benchmarks/paper_small.py --init embed-sqrt  # every family from one initialisation (default llama)

`--study` puts the families on benchmarks/lm_scaling.py's footing: its initialisations (INITS, by its `apply_init`,
the same code for every family), for each family and initialisation a learning-rate sweep, then every seed at the
best rate; the report gives every family at every initialisation and each at its best, with the paired
differences to Llama (mean, sd, 90% t interval: lm_scaling's functions). Reports in benchmarks/paper_small/study/
<task> (benchmarks/paper_small/README.md: the command for the full table and its cost).

Writes OUTPUT_DIR/report.md, results.json and the figures accuracy.png and attention_maps.png (retrieval) and
loss.png (text); OUTPUT_DIR is benchmarks/paper_small/<task> unless given. Runs go to `--jobs` processes; each
process builds the data itself and its checksum must agree. Each finished run is stored in OUTPUT_DIR/runs (its
figures, and its final model in bf16 with its sha256, from which every reported number is computed) and reused by a
later call with the same settings and the same text file content: a stopped experiment resumes, and `--seeds` can
grow. A run's training state is kept there too at each evaluation, so a stopped run resumes from its last
evaluation with the same result.
"""

import argparse
import functools
import hashlib
import importlib.util
import json
import multiprocessing
import random
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    get_cosine_schedule_with_warmup,
    get_wsd_schedule,
    set_seed,
)
from transformers.models.diffllama import modeling_diffllama
from transformers.models.llama import modeling_llama

from diff_transformer import DiffConfig, DiffForCausalLM, attention_kernels
from diff_transformer.tools.data import text_file_dataset
from diff_transformer.tools.evaluation import (
    CITIES,
    FILLER,
    MIN_ROW_SUM,
    NeedleSettings,
    activation_tensors,
    attention_maps,
    attention_noise,
    branches,
    build_needle_prompt,
    causal_entries,
    magnitude_stats,
    span_positions,
    needle,
    needle_accuracy,
    pyplot,
)
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer.tools.safe_write import remove_stale, staged_folder, write_file, write_text



def sibling(name: str):
    """The benchmark script `name`.py beside this one, as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lm_scaling = sibling("lm_scaling")  # the initialisations (INITS, apply_init) and the paired statistics
MODELS = ("DIFF", "DiffLlama", "Transformer")
SHOWN = {"DIFF": "DIFF", "DiffLlama": "DiffLlama", "Transformer": "Llama"}
INITIALISATION = ("initialisation: every model trained with Llama's initialisation (unscaled embeddings: DIFF's "
                  "`embedding_multiplier=1.0`); the package's default now scales DIFF's embeddings by sqrt(hidden), "
                  "see the single-epoch benchmark (benchmarks/lm_scaling)")


def initialisation_note(init: str) -> str:
    """The report's line on how every model was initialised."""
    if init == lm_scaling.BASE_INIT:
        return INITIALISATION
    return (f"initialisation: every model trained with `{init}` on top of Llama's initialisation (benchmarks/"
            f"lm_scaling.py's INITS, applied to every family by the same code: {lm_scaling.INITS[init]}; DIFF's "
            "`embedding_multiplier=1.0`, its embeddings scaled by the same hook as the others')")
DEPTHS = [0, 25, 50, 75, 100]
QUICK = dict(seeds=[0, 1], steps=40, batch=16, text_steps=40, long_steps=80, hidden=32, layers=2, heads=1,
             examples=160, context=64, needles=2, queries=1, eval_samples=2, curve_points=2, text_block=64, jobs=1,
             output_dir=Path("runs/paper-quick"))
OUTPUT_ROOT = Path("benchmarks/paper_small")  # one folder per task: the committed reports and runs


def build_models(vocab: int, args: argparse.Namespace) -> dict:
    """Same projection shapes: DIFF with h heads (q/k sub-heads d = hidden / 2h, values 2d), DiffLlama with 2h heads
    of dim d paired into h differential heads, Llama with 2h heads of dim d."""
    d = args.hidden // (2 * args.heads)
    shared = dict(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 16 * 16,
                  num_hidden_layers=args.layers, max_position_embeddings=1024, tie_word_embeddings=True)
    configs = {
        # Llama's initialisation for every model (DIFF's embeddings unscaled), as the stored runs were trained
        # (INITIALISATION, which every report states)
        "DIFF": (DiffForCausalLM, DiffConfig(**shared, num_attention_heads=args.heads, embedding_multiplier=1.0)),
        "DiffLlama": (DiffLlamaForCausalLM, DiffLlamaConfig(**shared, num_attention_heads=2 * args.heads,
                                                            num_key_value_heads=2 * args.heads, head_dim=d)),
        "Transformer": (LlamaForCausalLM, LlamaConfig(**shared, num_attention_heads=2 * args.heads, head_dim=d)),
    }
    return {name: cls._from_config(config, attn_implementation="sdpa") for name, (cls, config) in configs.items()}


def needle_settings(args: argparse.Namespace, samples: int, seed: int) -> NeedleSettings:
    return NeedleSettings(lengths=[args.context], depths=DEPTHS, needles=args.needles, queries=args.queries,
                          samples=samples, seed=seed, digits=args.digits)


def retrieval_text(tokenizer, args: argparse.Namespace, rng: random.Random) -> str:
    """One training sequence: a haystack as the evaluation builds it (queried needles at a random depth), then the
    question and answer of every needle in it, in random order: each sequence teaches N retrievals."""
    prompt = build_needle_prompt(tokenizer, args.context, rng.choice(DEPTHS), needle_settings(args, 1, 0), rng)
    needles = re.findall(r"The magic number of (\w+) is (\d+)\.", prompt.context)
    rng.shuffle(needles)
    answers = " ".join(f"What is the magic number of {c}? The magic number of {c} is {n}." for c, n in needles)
    return f"{prompt.context} {answers}"


def pad_rows(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])  # [N, width]


def retrieval_data(args: argparse.Namespace) -> tuple:
    seed_texts = list(FILLER) * 20 + [needle(c, str(1000 + i)) for i, c in enumerate(CITIES)] * 5
    seed_texts += [f"What is the magic number of {c}? The magic number of {c} is" for c in CITIES]
    tokenizer = train_bpe_tokenizer(texts=seed_texts, vocab_size=512)
    rng = random.Random(1)
    rows = [tokenizer(retrieval_text(tokenizer, args, rng))["input_ids"] for _ in range(args.examples + 128)]
    data = pad_rows(rows, tokenizer.pad_token_id)
    return tokenizer, data[:-128], data[-128:]


def text_data(args: argparse.Namespace) -> tuple:
    tokenizer = train_bpe_tokenizer(files=[args.data], vocab_size=1024)
    ids = torch.stack([block["input_ids"] for block in text_file_dataset(args.data, tokenizer, args.text_block)])
    split = int(0.9 * len(ids))
    return tokenizer, ids[:split], ids[split:]


def labels_for(batch: torch.Tensor, pad_id: int) -> torch.Tensor:
    return batch.masked_fill(batch == pad_id, -100)


def validation_loss(model, data: torch.Tensor, pad_id: int, device: str) -> float:
    with torch.no_grad():
        losses = [model(c.to(device), labels=labels_for(c, pad_id).to(device)).loss.item() for c in data.split(32)]
    return sum(losses) / len(losses)


def retrieval_accuracy(model, tokenizer, args: argparse.Namespace, samples: int) -> dict:
    """{depth: accuracy} over `samples` held-out prompts per depth, R questions each."""
    results = needle_accuracy(model, tokenizer, needle_settings(args, samples, seed=7))
    return {depth: value for (_, depth), value in results.items()}


def evaluate(task: str, model, tokenizer, val: torch.Tensor, args: argparse.Namespace, final: bool) -> dict:
    model.eval()
    point = {"val_loss": validation_loss(model, val, tokenizer.pad_token_id, args.device)}
    if task == "retrieval":
        depths = retrieval_accuracy(model, tokenizer, args, args.eval_samples * (4 if final else 1))
        point["accuracy"] = statistics.mean(depths.values())
        if final:
            point["accuracy_by_depth"] = depths
    model.train()
    return point


def lr_schedule(optimizer: torch.optim.Optimizer, kind: str, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 0, or (wsd) constant up to 80% and a
    cosine decay over the last 20%."""
    if kind == "wsd":
        return get_wsd_schedule(optimizer, max(1, steps // 10), num_decay_steps=steps // 5, num_training_steps=steps)
    return get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10), steps)


def train(task: str, model, tokenizer, data: tuple, args: argparse.Namespace, seed: int, steps: int,
          partial: Path) -> tuple[list, float]:
    """AdamW with a warm-up schedule (`lr_schedule`); the batch order depends on the seed only, so every model sees it.
    At each evaluation the whole training state is saved to `partial`, and a run finding one there resumes from it
    with the same result as if never stopped. Returns the evaluation curve [{step, val_loss, accuracy?}] and the
    seconds spent training and evaluating, counted across stops."""
    train_data, val = data
    retrieval = task == "retrieval"
    batch_size, lr = (args.batch, args.lr) if retrieval else (args.text_batch, args.text_lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.98))
    schedule = lr_schedule(optimizer, args.schedule if retrieval else "cosine", steps)
    order = torch.Generator().manual_seed(seed)
    checkpoints = {round(steps * (i + 1) / args.curve_points) for i in range(args.curve_points)}
    pad_id, parts = tokenizer.pad_token_id, {"model": model, "optimizer": optimizer, "schedule": schedule}
    curve, first, seconds = resume(partial, parts, order) if partial.is_file() else ([], 1, 0)
    start = time.monotonic() - seconds
    model.train()
    for step in range(first, steps + 1):
        batch = train_data[torch.randint(len(train_data), (batch_size,), generator=order)]
        model(batch.to(args.device), labels=labels_for(batch, pad_id).to(args.device)).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step in checkpoints:
            curve.append({"step": step, **evaluate(task, model, tokenizer, val, args, final=step == steps)})
            print(f"  {task} {type(model).__name__} seed {seed}: {curve[-1]}", flush=True)
            save_state(partial, parts, order, {"step": step, "curve": curve, "seconds": time.monotonic() - start})
    model.eval()
    return curve, time.monotonic() - start


def save_state(partial: Path, parts: dict, order: torch.Generator, progress: dict) -> None:
    """Save a run's whole training state: `parts` (model, optimizer, schedule), the batch order and `progress`
    (step, curve, seconds), for `resume`."""
    state = {**progress, "order": order.get_state(), **{name: part.state_dict() for name, part in parts.items()}}
    write_file(partial, lambda staged: torch.save(state, staged))  # whole or not at all: a kill keeps the last one


def resume(partial: Path, parts: dict, order: torch.Generator) -> tuple[list, int, float]:
    """Load a stopped run's state into `parts` (model, optimizer, schedule) and `order`: (curve so far, next step,
    seconds so far)."""
    state = torch.load(partial, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    order.set_state(state["order"])
    print(f"  resuming {partial.name} after step {state['step']}", flush=True)
    return state["curve"], state["step"] + 1, state["seconds"]


def noise_metrics(model, tokenizer, args: argparse.Namespace) -> dict:
    """Attention of the answering position to the answer needle and to the rest of the context (paper Table 3),
    averaged over held-out prompts at every depth (`evaluation.allocation`): "answer" / "noise" raw (the map that
    multiplies V), "normalized_answer" / "normalized_noise" each head's row divided by its sum (1 - lambda), the
    paper's comparison, over the heads kept (None if none is), "excluded": [layer, head, row sum] of the heads
    left out of the normalised figure in any prompt (|row sum| < "min_row_sum", MIN_ROW_SUM), and "by_threshold"
    (`threshold_means`: the normalised figures at other cut-offs)."""
    model.set_attn_implementation("eager")
    rng, settings = random.Random(11), needle_settings(args, 1, 0)
    prompts = [build_needle_prompt(tokenizer, args.context, depth, settings, rng)
               for depth in DEPTHS for _ in range(args.eval_samples)]
    reports = [attention_noise(model, tokenizer, prompt) for prompt in prompts]
    figure = figure_maps(model, tokenizer, prompts[len(prompts) // 2])
    model.set_attn_implementation("sdpa")
    excluded = {(layer, head): total for r in reports for layer, head, total in r["excluded"]}
    return {"answer": statistics.mean(r["mean_answer"] for r in reports),
            "noise": statistics.mean(r["mean_noise"] for r in reports),
            "normalized_answer": mean_defined([r["mean_normalized_answer"] for r in reports]),
            "normalized_noise": mean_defined([r["mean_normalized_noise"] for r in reports]),
            "excluded": [[layer, head, total] for (layer, head), total in sorted(excluded.items())],
            "min_row_sum": MIN_ROW_SUM, "by_threshold": threshold_means(reports), "figure": figure}


def mean_defined(values: list[float | None]) -> float | None:
    """The mean of the figures that are defined (a prompt whose every head is excluded has none); None if none is."""
    defined = [v for v in values if v is not None]
    return statistics.mean(defined) if defined else None


def threshold_means(reports: list[dict]) -> dict[str, dict]:
    """Per cut-off on |row sum| (`evaluation.threshold_sweep`, the same prompts as the normalised figures):
    "answer" / "noise" normalised, averaged over the prompts as `noise_metrics` averages them (None when every head
    is excluded in every prompt), and "excluded": [layer, head] of the heads left out in any prompt."""
    out = {}
    for threshold in reports[0]["by_threshold"]:
        sweeps = [r["by_threshold"][threshold] for r in reports]
        heads = sorted({tuple(head) for sweep in sweeps for head in sweep["excluded"]})
        out[threshold] = {"answer": mean_defined([sweep["answer"] for sweep in sweeps]),
                          "noise": mean_defined([sweep["noise"] for sweep in sweeps]),
                          "excluded": [list(head) for head in heads]}
    return out


def figure_maps(model, tokenizer, prompt) -> dict:
    """The maps of the head that gives the answer needle the most attention from the answering position, as in
    notebooks/03_attention_maps.ipynb: {"maps": {title: [T, S]}, "answer": positions of the needle}."""
    positions = span_positions(tokenizer, prompt.question(0), prompt)
    maps, branches = attention_maps(model, positions["input_ids"])
    on_answer = torch.stack([m[0, :, -1][:, positions["answer"]].sum(-1) for m in maps])  # [layers, heads]
    layer, head = divmod(on_answer.argmax().item(), on_answer.shape[1])
    panels = {"A1 - lambda A2" if branches else "softmax(Q K^T)": maps[layer][0, head]}
    if branches:
        a1, a2, lam = branches[layer]
        lam = lam.flatten()[head if lam.numel() > 1 else 0].item()
        panels = {"A1": a1[0, head], f"lambda A2 (lambda = {lam:.2f})": lam * a2[0, head], **panels}
    return {"maps": {k: v.cpu() for k, v in panels.items()}, "answer": positions["answer"].nonzero().flatten(),
            "where": f"layer {layer}, head {head}"}


# --- §3.8 of the paper: activation outliers and low-bit quantization, measured on the saved models ---

QUANT_BITS = (8, 6, 4)
TOP_K = 10  # the outlier table reports top-1 and top-10 magnitudes over the median


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-tensor fake quantization: scale = max|x| / (2^(bits-1) - 1), round x / scale to an integer,
    clamp to +-(2^(bits-1) - 1), multiply back. An all-zero tensor is returned as is."""
    levels = 2 ** (bits - 1) - 1
    scale = x.abs().max() / levels
    if scale == 0:
        return x
    return (x / scale).round().clamp(-levels, levels) * scale


def quantize_visible(scores: torch.Tensor, bits: int | None) -> torch.Tensor:
    """Fake-quantize masked attention logits [B, H, T, S] over the entries the softmax sees: masked ones hold the
    dtype's minimum (transformers' additive mask, `mask_scores_`), stay as they are and do not set the scale."""
    if bits is None:
        return scores
    visible = scores > torch.finfo(scores.dtype).min / 2
    return torch.where(visible, fake_quantize(scores.masked_fill(~visible, 0), bits), scores)


def quantized_eager_attention(original: Callable, bits: int | None) -> Callable:
    """transformers' own `eager_attention_forward` (`original`, of Llama or DiffLlama) with `quantize_visible` on the
    input of its softmax, the masked logits, for the duration of each call; bits None: the original's result."""
    softmax = torch.nn.functional.softmax

    def quantized_softmax(scores: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return softmax(quantize_visible(scores, bits), *args, **kwargs)

    def attention(*args, **kwargs):
        torch.nn.functional.softmax = quantized_softmax
        try:
            return original(*args, **kwargs)
        finally:
            torch.nn.functional.softmax = softmax

    return attention


@contextmanager
def quantized_attention_logits(model, bits: int | None) -> Iterator[None]:
    """Inside the block, the eager attention of every model fake-quantizes its pre-softmax logits to `bits`, one
    scale per attention call: DIFF through `attention_kernels.masked_scores` (called once per branch, [B, h, T, S]),
    Llama and DiffLlama through their module's `eager_attention_forward` (DiffLlama's [B, 2h, T, S] holds both
    branches). The functions are swapped in the modules for the block and restored after, even on error."""
    implementation = model.config._attn_implementation
    if implementation != "eager":
        raise ValueError(f"quantized_attention_logits needs eager attention, the model runs '{implementation}': "
                         'load it with attn_implementation="eager"')
    masked_scores = attention_kernels.masked_scores
    originals = [(attention_kernels, "masked_scores", masked_scores)]
    originals += [(module, "eager_attention_forward", module.eager_attention_forward)
                  for module in (modeling_llama, modeling_diffllama)]
    attention_kernels.masked_scores = lambda q, k, mask, scaling: quantize_visible(masked_scores(q, k, mask, scaling),
                                                                                   bits)
    for module, name, original in originals[1:]:
        setattr(module, name, quantized_eager_attention(original, bits))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


@contextmanager
def quantized_activations(model, bits: int) -> Iterator[None]:
    """Inside the block, the hidden states entering each decoder layer [B, T, hidden] are fake-quantized to `bits`
    (one scale per layer and forward), by forward pre-hooks removed after the block."""

    def hook(module, args, kwargs):
        if args:
            return (fake_quantize(args[0], bits), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fake_quantize(kwargs["hidden_states"], bits)}

    handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def task_metric(task: str, model, tokenizer, val: torch.Tensor, args: argparse.Namespace) -> float:
    """The number the quantization table reports: validation loss (text) or final retrieval accuracy."""
    if task == "retrieval":
        return statistics.mean(retrieval_accuracy(model, tokenizer, args, args.eval_samples * 4).values())
    return validation_loss(model, val, tokenizer.pad_token_id, args.device)


def quantization_metrics(task: str, model, tokenizer, val: torch.Tensor, args: argparse.Namespace) -> dict:
    """{"none": metric, "attention logits": {bits: metric}, "activations": {bits: metric}} of an eager model."""
    out = {"none": task_metric(task, model, tokenizer, val, args), "attention logits": {}, "activations": {}}
    for bits in QUANT_BITS:
        with quantized_attention_logits(model, bits):
            out["attention logits"][bits] = task_metric(task, model, tokenizer, val, args)
        with quantized_activations(model, bits):
            out["activations"][bits] = task_metric(task, model, tokenizer, val, args)
    return out


def outlier_inputs(task: str, tokenizer, val: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    """Held-out inputs for the outlier table: 8 validation blocks [8, T] (text), or the attention-noise question
    prompts [1, T] at every depth (retrieval, no padding)."""
    if task != "retrieval":
        return [val[:8]]
    rng, settings = random.Random(11), needle_settings(args, 1, 0)
    prompts = [build_needle_prompt(tokenizer, args.context, depth, settings, rng)
               for depth in DEPTHS for _ in range(args.eval_samples)]
    return [tokenizer(p.question(0), return_tensors="pt")["input_ids"] for p in prompts]


def magnitude_summary(values: list[torch.Tensor]) -> dict:
    stats = magnitude_stats(values, TOP_K)
    top, median = stats["top"], stats["median"]
    return {"top1": top[0], "median": median, "top1 / median": top[0] / median, "top10 / median": top[-1] / median}


def outlier_metrics(model, inputs: list[torch.Tensor]) -> dict:
    """{activation: {top1, median, top1 / median, top10 / median}} over every input together (the median exact, of
    all values: `evaluation.magnitude_stats`): attention logits (causal entries) over all heads, both branches pooled
    as the paper's Table 5 and `diff-transformer outliers` count them; for the differential models also each branch
    alone (`evaluation.branches`: heads [:h] and [h:]); hidden states: every decoder layer's output (the residual
    stream after each layer, not the final norm's output)."""
    pooled, split, hidden = [], [], []
    for ids in inputs:
        scores, states = activation_tensors(model, ids)  # per layer [B, H, T, T], [B, T, hidden]
        pooled += [causal_entries(s) for s in scores]
        split += [pair for layer, s in zip(model.model.layers, scores) if (pair := branches(layer.self_attn, s))]
        hidden += states
    groups = {"attention logits": pooled}
    groups.update({f"attention logits, branch {b + 1}": [causal_entries(p[b]) for p in split]
                   for b in (0, 1) if split})
    return {**{name: magnitude_summary(group) for name, group in groups.items()},
            "hidden states": magnitude_summary(hidden)}


def analysis(task: str, folder: Path, tokenizer, val: torch.Tensor, args: argparse.Namespace) -> dict:
    """The §3.8 numbers of one saved model, loaded with eager attention (what the quantization hooks wrap)."""
    model = load_saved(folder, args, "eager")
    return {"outliers": outlier_metrics(model, outlier_inputs(task, tokenizer, val, args)),
            "quantization": quantization_metrics(task, model, tokenizer, val, args)}


# --- saved models: each run's final weights as a from_pretrained folder next to its stored run ---


def model_path(unit: tuple) -> Path:
    """OUTPUT_DIR/runs/<stored run's name>.model: the run's final model (bf16) and tokenizer, committed with the run."""
    return stored_path(unit).with_suffix(".model")


def weights_sha256(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def save_model(model, tokenizer, folder: Path) -> str:
    """save_pretrained in bf16 (safetensors, half of fp32: the folders are committed) with the tokenizer; returns the
    weights' sha256. Every reported number of the run is computed from this stored copy (`measure`), loaded back in
    fp32, so the report and `--from-saved` agree exactly. `model` is left in bf16."""
    model.to(torch.bfloat16)
    with staged_folder(folder, replace=True) as staged:  # whole or absent, never a half-written model
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        for code in staged.glob("*.py"):  # DIFF's copy of the package's code: the installed package loads the folder
            code.unlink()
    return weights_sha256(folder)


def load_saved(folder: Path, args: argparse.Namespace, attention: str = "sdpa"):
    """A run's saved model in fp32, with its initialisation's embedding scale (a hook, not in the weights)."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention, dtype=torch.float32)
    return lm_scaling.scale_embeddings(model, args.init).to(args.device).eval()


class SavedRunError(RuntimeError):
    """A stored run whose saved model is missing or not the one that made its figures."""


def check_saved(unit: tuple) -> dict:
    """The stored row of a unit whose saved folder exists and has the stored checksum; else one line with the fix."""
    stored, folder = stored_path(unit), model_path(unit)
    retrain = f"delete {stored} and run the same command without --from-saved to train it again"
    if not stored.is_file():
        raise SavedRunError(f"{stored.name}: not stored; run the same command without --from-saved to train it")
    row = torch.load(stored, weights_only=True)
    if "model_sha256" not in row:
        raise SavedRunError(f"{stored.name}: stored before runs saved their model; {retrain}")
    if not (folder / "model.safetensors").is_file():
        raise SavedRunError(f"{stored.name}: its saved model {folder} is missing; {retrain}")
    if (digest := weights_sha256(folder)) != row["model_sha256"]:
        raise SavedRunError(f"{stored.name}: {folder}/model.safetensors has sha256 {digest[:16]}, the stored run "
                            f"{row['model_sha256'][:16]}: another model; {retrain}")
    return row


def measure(task: str, folder: Path, tokenizer, val: torch.Tensor, args: argparse.Namespace) -> dict:
    """Every reported number of a saved model: final validation loss (and retrieval accuracy, attention to the
    answer and noise, the map figure) and the §3.8 analysis."""
    model = load_saved(folder, args)
    row = evaluate(task, model, tokenizer, val, args, final=True)
    if task == "retrieval":
        row.update(noise_metrics(model, tokenizer, args))
    return {**row, **analysis(task, folder, tokenizer, val, args)}


def from_saved(unit: tuple) -> dict:
    """A stored row with every reported number recomputed from the saved model (`measure`), without training. The
    curve along training (and the best validation loss on it) is the stored one."""
    task, name, seed, _, args = unit
    row = check_saved(unit)
    torch.set_num_threads(args.threads)
    tokenizer, train_data, val = retrieval_data(args) if task == "retrieval" else text_data(args)
    if data_digest(train_data) != row["data"]:
        raise SavedRunError(f"{stored_path(unit).name}: the data built now differs from the run's (checksum "
                            f"{data_digest(train_data)} vs {row['data']}); use the settings and files it was run with")
    print(f"{task} {name} seed {seed}: recomputing from {model_path(unit).name}", flush=True)
    return {**row, **measure(task, model_path(unit), tokenizer, val, args)} if args.figures else row



def run_unit(unit: tuple) -> dict:
    """Train one model on one task with one seed, evaluating along the way; save the final model (`model_path`, bf16,
    its checksum in the row) and compute every reported number from that folder (`measure`)."""
    task, name, seed, steps, args = unit
    torch.set_num_threads(args.threads)
    tokenizer, train_data, val = retrieval_data(args) if task == "retrieval" else text_data(args)
    set_seed(seed)
    model = lm_scaling.apply_init(build_models(len(tokenizer), args)[name], args.init).to(args.device)
    curve, seconds = train(task, model, tokenizer, (train_data, val), args, seed, steps, partial_path(unit))
    row = {"task": task, "model": name, "seed": seed, "steps": steps, "params": model.num_parameters(),
           "data": data_digest(train_data), "curve": curve, **curve[-1], "seconds": seconds,
           "best_val_loss": min(p["val_loss"] for p in curve), "init": args.init,
           "lr": args.lr if task == "retrieval" else args.text_lr}
    row["model_sha256"] = save_model(model, tokenizer, model_path(unit))
    if args.figures:  # a sweep run keeps the figures of its last evaluation along training only
        row.update(measure(task, model_path(unit), tokenizer, val, args))
    print(f"{task} {name} seed {seed} ({steps} steps, {row['seconds']:.0f}s): val loss {row['val_loss']:.3f}"
          + (f", accuracy {row['accuracy']:.3f}" if task == "retrieval" else "")
          + (f", answer {row['answer']:.3f}, noise {row['noise']:.3f}" if "answer" in row else "")
          + (f"; accuracy along training {[round(p['accuracy'], 3) for p in curve]}" if task == "retrieval" else ""),
          flush=True)
    return row


def data_digest(data: torch.Tensor) -> str:
    """Same data in every process: a hash of the token ids."""
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def units(args: argparse.Namespace) -> list[tuple]:
    """Every (task, model, seed, steps) run, longest first so that parallel workers finish together."""
    plan = []
    if "retrieval" in args.tasks:
        plan += [("retrieval", m, s, args.steps) for s in args.seeds for m in args.models]
    if "text" in args.tasks and not args.data.is_file() and not plan:
        raise SystemExit(f"error: the text experiment needs a UTF-8 corpus, and {args.data} is not a file: pass "
                         "--data FILE (any plain-text file of a few hundred KB, e.g. tiny Shakespeare)")
    if "text" in args.tasks and not args.data.is_file():
        print(f"skipping the text experiment: {args.data} not found (pass --data FILE)")
    elif "text" in args.tasks:
        plan += [("text", m, s, args.text_steps) for s in args.seeds for m in args.models]
        plan += [("text-long", m, args.seeds[0], args.long_steps) for m in args.models] if args.long_steps else []
    return sorted(plan, key=lambda u: -u[3])


def start_worker() -> None:
    """A pool worker ends with the process that started it (`lm_scaling.die_with_parent`)."""
    lm_scaling.die_with_parent()


def run_all(plan: list[tuple], jobs: int) -> Iterator[dict]:
    """run_unit over (task, model, seed, steps, args) units, in `jobs` processes; rows in plan order."""
    if jobs == 1:
        yield from map(run_unit, plan)
        return
    with multiprocessing.get_context("spawn").Pool(jobs, start_worker) as pool:
        yield from pool.imap(run_unit, plan, chunksize=1)


# Settings that change no run's result (`quick` only sets others), and those only one task reads: a stored run is
# reused whatever they are.
RUN_INDEPENDENT = ("seeds", "models", "tasks", "jobs", "threads", "output_dir", "calibrate", "calibrate_needles",
                   "quick", "from_saved", "study", "inits", "lrs", "text_lrs", "sweep_fraction", "figures", "init")
TEXT_ONLY = ("data", "text_steps", "long_steps", "text_batch", "text_lr", "text_block")
RETRIEVAL_ONLY = ("steps", "batch", "lr", "schedule", "context", "needles", "queries", "digits", "examples",
                  "eval_samples")


# Corpora the reports name by their sha256 (docs/evaluation.md says where to get them).
KNOWN_CORPORA = {"86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed": "tiny Shakespeare"}


@functools.cache
def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stored_path(unit: tuple) -> Path:
    """OUTPUT_DIR/runs/<task>-<model>-seed<seed>-<hash of the settings the task reads>.pt: one finished run, figures
    included. The text file counts by its content (sha256), not its path: the same corpus anywhere is the same run."""
    task, name, seed, _, args = unit
    ignored = RUN_INDEPENDENT + (TEXT_ONLY if task == "retrieval" else RETRIEVAL_ONLY)
    settings = {k: str(v) for k, v in sorted(vars(args).items()) if k not in ignored}
    if "data" in settings:
        settings["data"] = file_sha256(args.data.resolve())
    if args.init != lm_scaling.BASE_INIT:  # runs of Llama's initialisation keep their earlier names
        settings["init"] = args.init
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:10]
    return args.output_dir / "runs" / f"{task}-{name}-seed{seed}-{digest}.pt"


def partial_path(unit: tuple) -> Path:
    """Where a run keeps its training state between evaluations until it is stored (not committed: .gitignore)."""
    return stored_path(unit).with_suffix(".partial.pt")


def run_or_load(plan: list[tuple], jobs: int) -> list[dict]:
    """Rows of every unit in plan order: each finished run is stored as it ends, and a stored run with the same
    settings is loaded instead of run again, so seeds can be added to an experiment and a stopped one resumed."""
    for folder in {stored_path(u).parent for u in plan}:
        remove_stale(folder)  # what writers killed part-way left (their staging files and folders)
    todo = [u for u in plan if not stored_path(u).is_file() or not has_saved_model(stored_path(u))]
    for unit, row in zip(todo, run_all(todo, max(1, min(jobs, len(todo)))), strict=True):
        write_file(stored_path(unit), lambda staged, row=row: torch.save(row, staged))
        partial_path(unit).unlink(missing_ok=True)
    return [torch.load(stored_path(u), weights_only=True) for u in plan]


def has_saved_model(stored: Path) -> bool:
    """Whether a stored run recorded its saved model; one stored before runs saved their model did not and is
    trained again."""
    if "model_sha256" in torch.load(stored, weights_only=True):
        return True
    print(f"training {stored.name} again: it was stored before runs saved their model", flush=True)
    return False


def text_task(row: dict) -> str:
    return "text" if row["task"] == "text-long" else row["task"]


def check_same_data(rows: list[dict]) -> None:
    for task in {text_task(r) for r in rows}:
        digests = {r["data"] for r in rows if text_task(r) == task}
        if len(digests) != 1:
            raise RuntimeError(f"the {task} runs saw different data: checksums {digests}")


NOT_STORED = "not stored"  # a figure the stored run predates; `--from-saved` on its model adds it


def cell(values: list) -> str:
    """mean ± sd over seeds; a run's figure may be a reason instead (a str): the first one is shown."""
    if reasons := [v for v in values if isinstance(v, str)]:
        return reasons[0]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {spread:.3f}"


def share(row: dict) -> float | str:
    """answer / (answer + noise) of the run's raw means: a common scale of the rows (such as 1 - lambda) cancels."""
    total = row["answer"] + row["noise"]
    return row["answer"] / total if total else "undefined (answer + noise = 0)"


def normalized(field: str) -> Callable[[dict], float | str]:
    def get(row: dict) -> float | str:
        if field not in row:
            return NOT_STORED
        return "every head excluded" if row[field] is None else row[field]
    return get


# The columns of each experiment's table: (title, figure of one run).
COLUMNS = {
    "retrieval": [("val_loss", lambda r: r["val_loss"]), ("accuracy", lambda r: r["accuracy"]),
                  ("answer, normalised", normalized("normalized_answer")),
                  ("noise, normalised", normalized("normalized_noise")), ("answer, raw", lambda r: r["answer"]),
                  ("noise, raw", lambda r: r["noise"]), ("share", share)],
    "text": [("val_loss", lambda r: r["val_loss"]), ("best_val_loss", lambda r: r["best_val_loss"])],
}
COLUMNS["text-long"] = COLUMNS["text"]
TITLES = {"retrieval": "Multi-needle retrieval, attention to the answer and attention noise",
          "text": "Validation loss on the text file", "text-long": "Validation loss, the long run (one seed)"}
NOISE_NOTE = ("Attention of the answering position (paper Table 3), averaged over heads, layers and the held-out "
              "prompts: normalised is each head's row divided by its sum (1 - lambda; 1 for softmax), the paper's "
              "comparison; raw is the map that multiplies V; share is raw answer / (raw answer + raw noise).")


def threshold_table(group: list[dict]) -> list[str]:
    """Markdown: per model and cut-off on |row sum|, the normalised answer and noise (mean ± sd over seeds) and the
    heads each seed leaves out; "every head excluded" where a seed keeps none."""
    if not all("by_threshold" in r for r in group):
        return []
    cutoffs = list(group[0]["by_threshold"])
    out = [f"How the normalised figures move with the cut-off (heads whose attention row sums to less than it in "
           f"magnitude are left out; the figures above use {MIN_ROW_SUM:g}):", "",
           "| model | cut-off | answer, normalised | noise, normalised | heads left out, per seed |",
           "|---|---|---|---|---|"]
    for name in MODELS:
        runs = sorted((r for r in group if r["model"] == name), key=lambda r: r["seed"])
        for cutoff in cutoffs if runs else ():
            sweeps = [(r["seed"], r["by_threshold"][cutoff]) for r in runs]
            figures = [cell([s[f] if s[f] is not None else f"undefined (seed {seed}: every head excluded)"
                             for seed, s in sweeps]) for f in ("answer", "noise")]
            left_out = ", ".join(str(len(s["excluded"])) for _, s in sweeps)
            out.append(f"| {name} | {cutoff} | {' | '.join(figures)} | {left_out} |")
    return out + [""]


def excluded_note(group: list[dict]) -> str:
    """Which heads the normalised figures leave out, per run: a row sum under MIN_ROW_SUM cannot be divided by."""
    runs = [f"{r['model']} seed {r['seed']}: " + ", ".join(f"layer {layer} head {head} ({total:.3f})"
                                                           for layer, head, total in r["excluded"])
            for r in group if r.get("excluded")]
    if not any("excluded" in r for r in group):
        return "Normalised figures: not stored for these runs (measured before they were added)."
    return (f"Heads left out of the normalised figures (|row sum| < {MIN_ROW_SUM:g}): "
            + ("; ".join(runs) if runs else "none") + ".")


def per_run_table(group: list[dict], columns: list[tuple]) -> list[str]:
    """Markdown: one line per run (model, seed), in model then seed order."""
    out = ["| model | seed | " + " | ".join(title for title, _ in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
    for row in sorted(group, key=lambda r: (MODELS.index(r["model"]), r["seed"])):
        cells = " | ".join(v if isinstance(v := get(row), str) else f"{v:.3f}" for _, get in columns)
        out.append(f"| {row['model']} | {row['seed']} | {cells} |")
    return out


def summarize(rows: list[dict]) -> str:
    """Markdown, per experiment: mean ± standard deviation over seeds, then every run."""
    out = []
    for task, columns in COLUMNS.items():
        group = [r for r in rows if r["task"] == task]
        if not group:
            continue
        out += [f"### {TITLES[task]}", "", f"{len({r['seed'] for r in group})} seed(s), {group[0]['steps']} steps", "",
                "| model | params | " + " | ".join(title for title, _ in columns) + " |",
                "|---|---|" + "---|" * len(columns)]
        for name in MODELS:
            runs = [r for r in group if r["model"] == name]
            if runs:
                cells = " | ".join(cell([get(r) for r in runs]) for _, get in columns)
                out.append(f"| {name} | {runs[0]['params'] / 1e6:.3f}M | {cells} |")
        notes = [NOISE_NOTE, "", excluded_note(group), "", *threshold_table(group)]
        out += ["", *(notes if task == "retrieval" else []),
                "Per run:", "", *per_run_table(group, columns), ""]
    return "\n".join(out)


PAPER = ("Paper (§3.8, 3B-size models), beside the same measurements only: top-1 attention logit 38.8 (DIFF) vs "
         "318.0 (Transformer) and top-1 hidden state 1688.2 vs 3608.6 (Table 5, absolute values); attention logits "
         "quantized to 6 and 4 bits keep DIFF's zero-shot accuracy where the Transformer's drops (Figure 8). The "
         "paper quantizes attention logits only: the activation rows are this project's extension.")
QUANT_METRIC = {"retrieval": "retrieval accuracy", "text": "validation loss", "text-long": "validation loss"}
QUANT_KINDS = {"attention logits": "attention logits (the paper's Figure 8)",
               "activations": "activations (extension: not in the paper)"}


def spread_apart(a: list[float], b: list[float]) -> bool:
    """Whether two models' means differ by more than the sum of their spreads over seeds (and than 1% of the larger
    mean and 1e-3, so that equal numbers of single-seed or zero-spread runs are not called apart)."""
    spread = sum(statistics.stdev(v) if len(v) > 1 else 0.0 for v in (a, b))
    means = statistics.mean(a), statistics.mean(b)
    return abs(means[0] - means[1]) > max(spread, 0.01 * max(map(abs, means)), 1e-3)


def outlier_kinds(runs: list[dict]) -> list[str]:
    """The activations of a model's outlier rows: pooled attention logits first, then each branch, hidden states."""
    kinds = list(dict.fromkeys(k for r in runs for k in r["outliers"]))
    return sorted(kinds, key=lambda k: (k != "attention logits", k == "hidden states", k))


def outlier_table(group: list[dict]) -> list[str]:
    """Markdown rows: per model and activation, top-1, median and top-1 / top-10 over the median (mean ± sd)."""
    fields = ("top1", "median", "top1 / median", "top10 / median")
    out = ["| model | activation | " + " | ".join(fields) + " |", "|---|---|" + "---|" * len(fields)]
    for name in MODELS:
        runs = [r for r in group if r["model"] == name]
        for kind in outlier_kinds(runs):
            label = kind if kind != "attention logits" or name == "Transformer" else "attention logits, both branches"
            cells = " | ".join(cell([r["outliers"][kind][f] if kind in r["outliers"] else NOT_STORED for r in runs])
                               for f in fields)
            out.append(f"| {name} | {label} | {cells} |")
    return out


def quantization_table(group: list[dict]) -> list[str]:
    """Markdown rows: per model and quantized tensor, the metric unquantized and at each bit width (mean ± sd)."""
    out = ["| model | quantized | none | " + " | ".join(f"{b} bits" for b in QUANT_BITS) + " |",
           "|---|---|---|" + "---|" * len(QUANT_BITS)]
    for name in MODELS:
        runs = [r["quantization"] for r in group if r["model"] == name]
        for kind in QUANT_KINDS if runs else ():
            cells = " | ".join(cell([q[kind][b] for q in runs]) for b in QUANT_BITS)
            out.append(f"| {name} | {QUANT_KINDS[kind]} | {cell([q['none'] for q in runs])} | {cells} |")
    return out


def reading(task: str, group: list[dict]) -> list[str]:
    """DIFF against the Transformer on the paper's claims: apart only if the means differ by more than the spreads."""
    def values(name: str, get) -> list[float]:
        return [get(r) for r in group if r["model"] == name]

    def verdict(what: str, get) -> str:
        diff, llama = values("DIFF", get), values("Transformer", get)
        if not diff or not llama:
            return f"- {what}: needs DIFF and Transformer runs"
        if NOT_STORED in diff + llama:
            return f"- {what}: {NOT_STORED} for these runs"
        if not spread_apart(diff, llama):
            return (f"- {what}: DIFF {statistics.mean(diff):.3f}, Transformer {statistics.mean(llama):.3f}: "
                    "within the spread over seeds, no difference at this scale")
        lower = "lower" if statistics.mean(diff) < statistics.mean(llama) else "higher"
        return f"- {what}: DIFF {statistics.mean(diff):.3f}, Transformer {statistics.mean(llama):.3f}: DIFF {lower}"

    low = QUANT_BITS[-1]
    pooled = "attention logits"
    return [verdict("top-1 attention logit over the median (both branches pooled)",
                    lambda r: r["outliers"][pooled]["top1 / median"] if pooled in r["outliers"] else NOT_STORED),
            verdict("top-1 hidden state over the median", lambda r: r["outliers"]["hidden states"]["top1 / median"]),
            *[verdict(f"change of {QUANT_METRIC[task]} with {QUANT_KINDS[kind]} at {low} bits",
                      lambda r, kind=kind: r["quantization"][kind][low] - r["quantization"]["none"])
              for kind in QUANT_KINDS]]


def paper_tables(rows: list[dict]) -> str:
    """Markdown: the §3.8 outlier and quantization tables of every task whose runs carry them, and the reading."""
    out = []
    for task in ("retrieval", "text", "text-long"):
        group = [r for r in rows if r["task"] == task and "outliers" in r]
        if not group:
            continue
        seeds = f"{len({r['seed'] for r in group})} seed(s), {group[0]['steps']} steps, eager attention"
        out += [f"### Activation outliers, {task} (paper Table 5)", "", seeds, "", *outlier_table(group), "",
                f"### Fake quantization, {task}: {QUANT_METRIC[task]} (paper Figure 8: attention logits)", "",
                f"{seeds}; symmetric per-tensor: scale = max|x| / (2^(bits-1) - 1)", "",
                *quantization_table(group), "", "Reading (DIFF against the Transformer):", "",
                *reading(task, group), ""]
    return "\n".join(out + ([PAPER, ""] if out else []))


def plot_paper_tables(rows: list[dict], task: str, path: Path) -> None:
    """Outliers (top-1 over the median per activation, bars per model with the min-max over seeds) and the metric
    against bits for quantized attention logits and activations (mean over seeds, min-max band)."""
    plt = pyplot()
    group = [r for r in rows if r["task"] == task and "outliers" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    names = [n for n in MODELS if any(r["model"] == n for r in group)]
    kinds = list(dict.fromkeys(k for r in group for k in r["outliers"]))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        runs = [r for r in group if r["model"] == name]
        label = name
        for j, kind in enumerate(kinds):
            values = [r["outliers"][kind]["top1 / median"] for r in runs if kind in r["outliers"]]
            if values:
                mean = statistics.mean(values)
                axes[0].bar(j + i * width, mean, width, yerr=[[mean - min(values)], [max(values) - mean]],
                            color=f"C{i}", label=label)
                label = None  # one legend entry per model
        bits = ["none", *map(str, QUANT_BITS)]
        for ax, kind in zip(axes[1:], ("attention logits", "activations")):
            values = torch.tensor([[r["quantization"]["none"], *[r["quantization"][kind][b] for b in QUANT_BITS]]
                                   for r in runs])  # [seeds, 1 + bit widths]
            ax.plot(bits, values.mean(0), marker="o", color=f"C{i}", label=name)
            ax.fill_between(bits, values.min(0).values, values.max(0).values, color=f"C{i}", alpha=0.2)
            ax.set(title=f"{kind} fake-quantized", xlabel="bits", ylabel=QUANT_METRIC[task])
            ax.legend()
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], [k.replace("attention logits", "logits")
                                                                          for k in kinds], fontsize=8)
    axes[0].set(title=f"{task}: top-1 magnitude over the median", yscale="log")
    axes[0].legend()
    fig.tight_layout()
    write_file(path, lambda staged: fig.savefig(staged, dpi=100))
    plt.close(fig)


def plot_curves(rows: list[dict], panels: list[tuple], path: Path) -> None:
    """One panel per (task, field, title): per model the mean over seeds along training, the band from min to max."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (task, field, title) in zip(axes[0], panels):
        for name in MODELS:
            runs = [r for r in rows if r["task"] == task and r["model"] == name]
            if not runs:
                continue
            steps = [p["step"] for p in runs[0]["curve"]]
            values = torch.tensor([[p[field] for p in r["curve"]] for r in runs])  # [seeds, points]
            line = ax.plot(steps, values.mean(0), marker="o", markersize=3, label=name)[0]
            ax.fill_between(steps, values.min(0).values, values.max(0).values, color=line.get_color(), alpha=0.2)
        ax.set(title=title, xlabel="training step", ylabel=field.replace("_", " "))
        ax.legend()
    fig.tight_layout()
    write_file(path, lambda staged: fig.savefig(staged, dpi=110))
    plt.close(fig)


def plot_maps(rows: list[dict], path: Path) -> None:
    """The trained retrieval models' maps of the head that attends most to the answer needle (first seed): rows are
    models, the last column the map that multiplies V; the answer needle's keys are marked."""
    plt = pyplot()
    retrieval = [r for r in rows if r["task"] == "retrieval"]
    seed = min(r["seed"] for r in retrieval)
    figures = {name: r["figure"] for name in MODELS for r in retrieval if r["model"] == name and r["seed"] == seed}
    fig, axes = plt.subplots(len(figures), 3, figsize=(13, 4 * len(figures)), squeeze=False)
    for row_axes, (name, figure) in zip(axes, figures.items()):
        panels = list(figure["maps"].items())
        for ax in row_axes[: 3 - len(panels)]:
            ax.axis("off")
        for ax, (title, values) in zip(row_axes[3 - len(panels) :], panels):
            limit = values.abs().flatten().quantile(0.995).item()  # the first key's sink would wash out the rest
            image = ax.imshow(values, cmap="RdBu_r", vmin=-limit, vmax=limit)
            for key in (figure["answer"].min().item() - 0.5, figure["answer"].max().item() + 0.5):
                ax.axvline(key, color="orange", linewidth=0.8)
            ax.set(title=f"{name}: {title}", xlabel="key (orange: answer needle)", ylabel=f"query ({figure['where']})")
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    write_file(path, lambda staged: fig.savefig(staged, dpi=90))
    plt.close(fig)


def write_outputs(rows: list[dict], args: argparse.Namespace) -> str:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    # what the runs depend on (not jobs, threads, folders, --from-saved: a report is the same whichever call wrote it);
    # the corpus by its content, not by the name or folder this machine keeps it under
    ignored = (RUN_INDEPENDENT + (TEXT_ONLY if "text" not in args.tasks else ())
               + (RETRIEVAL_ONLY if "retrieval" not in args.tasks else ()))
    settings = {k: v for k, v in vars(args).items() if k not in ignored}
    if "data" in settings:
        digest = file_sha256(args.data.resolve()) if args.data.is_file() else None
        settings["data"] = (f"{KNOWN_CORPORA.get(digest, 'a text file')} (sha256 {digest})" if digest
                            else f"{args.data.name} (not found: no text runs)")
    report = (f"# DIFF vs DiffLlama vs Transformer, small scale\n\nsettings: {settings}\n\n"
              f"{initialisation_note(args.init)}\n\n"
              f"run time: the {len(rows)} runs took {sum(r['seconds'] for r in rows) / 60:.1f} min of one process "
              f"each to train and measure\n\n"
              f"{summarize(rows)}\n{paper_tables(rows)}")
    write_text(args.output_dir / "report.md", report)
    plain = [{k: v for k, v in r.items() if k != "figure"} for r in rows]
    write_text(args.output_dir / "results.json", json.dumps({"settings": settings, "rows": plain}, indent=1))
    tasks = {r["task"] for r in rows}
    if pyplot() is not None and "retrieval" in tasks:
        panels = [("retrieval", "accuracy", "Multi-needle retrieval accuracy"),
                  ("retrieval", "val_loss", "Retrieval task validation loss")]
        plot_curves(rows, panels, args.output_dir / "accuracy.png")
        plot_maps(rows, args.output_dir / "attention_maps.png")
    for task in sorted(t for t in tasks if pyplot() is not None and any(r["task"] == t and "outliers" in r
                                                                         for r in rows)):
        plot_paper_tables(rows, task, args.output_dir / f"outliers_quantization_{task}.png")
    if pyplot() is not None and "text" in tasks:
        plot_curves(rows, [(t, "val_loss", title) for t, title in (("text", "Text validation loss"),
                                                                     ("text-long", "Text validation loss, long run"))
                           if t in tasks], args.output_dir / "loss.png")
    return report


# --- the study: every family at every initialisation, each with its own learning-rate sweep (as lm_scaling does) ---

STUDY_ROOT = OUTPUT_ROOT / "study"  # one folder per task; runs/ there is not committed (.gitignore: runs/)
# The figures a study reports per task: (row field, title, which is better); the first picks each family's best
# initialisation. The learning rate is picked by the final validation loss of the sweep run on both tasks.
STUDY_METRICS = {"text": [("val_loss", "validation loss", min)],
                 "retrieval": [("accuracy", "retrieval accuracy", max), ("val_loss", "validation loss", min)]}


def run_args(args: argparse.Namespace, init: str, lr: float, steps: int | None = None,
             figures: bool = True, long: bool = False) -> argparse.Namespace:
    """A copy of `args` for one run of the study (of its task, args.tasks[0]): its initialisation, learning rate and,
    for a sweep run, its step budget; `figures` False skips the §3.8 and attention figures (`measure`). A text run
    other than the `long` one reads no --long-steps: it is stored under 0, so the study's runs are the same with or
    without its long run."""
    task = args.tasks[0]
    budget = {"lr": lr} if task == "retrieval" else {"text_lr": lr, "long_steps": args.long_steps if long else 0}
    if steps is not None:
        budget |= {"steps": steps} if task == "retrieval" else {"text_steps": steps}
    return argparse.Namespace(**{**vars(args), **budget, "init": init, "figures": figures})


def run_rows(plan: list[tuple], args: argparse.Namespace) -> list[dict]:
    """The rows of `plan`: trained (or loaded from the store), or with --from-saved recomputed from the saved models."""
    rows = [from_saved(u) for u in plan] if args.from_saved else run_or_load(plan, args.jobs)
    check_same_data(rows)
    return rows


def study(args: argparse.Namespace) -> dict:
    """One task (args.tasks[0]): for every initialisation in args.inits and every family, a learning-rate sweep
    (seed args.seeds[0], args.sweep_fraction of the budget, picked by final validation loss), then every seed at the
    best rate; for text, the long run (seed args.seeds[0]) of each family at its best initialisation. Every run is
    stored under its settings (`stored_path`), so a stopped study resumes and one split across machines (say by
    --inits or --models) joins by copying the runs/ folders together."""
    task = args.tasks[0]
    full = args.steps if task == "retrieval" else args.text_steps
    grid = args.lrs if task == "retrieval" else args.text_lrs
    sweep_steps = max(2, round(full * args.sweep_fraction))
    pairs = [(init, m) for init in args.inits for m in args.models]
    plan = [(task, m, args.seeds[0], sweep_steps, run_args(args, init, lr, sweep_steps, figures=False))
            for init, m in pairs for lr in grid]
    swept = run_rows(plan, args)
    done = iter(swept)
    sweep = {init: {m: {f"{lr:g}": next(done)["val_loss"] for lr in grid} for m in args.models} for init in args.inits}
    lrs = {init: {m: min(grid, key=lambda lr: sweep[init][m][f"{lr:g}"]) for m in args.models} for init in args.inits}
    plan = [(task, m, s, full, run_args(args, init, lrs[init][m])) for init, m in pairs for s in args.seeds]
    rows = run_rows(plan, args)
    field, _, better = STUDY_METRICS[task][0]
    best = {m: better(args.inits, key=lambda init: statistics.mean(
        r[field] for r in rows if r["model"] == m and r["init"] == init)) for m in args.models}
    if task == "text" and args.long_steps:
        rows += run_rows([("text-long", m, args.seeds[0], args.long_steps,
                           run_args(args, best[m], lrs[best[m]][m], long=True)) for m in args.models], args)
    return {"task": task, "grid": grid, "sweep_steps": sweep_steps, "sweep": sweep, "lr": lrs, "best_init": best,
            "sweep_seconds": sum(r["seconds"] for r in swept),
            "train_sequences": len(text_data(args)[1]) if task == "text" else None,
            "batch": args.text_batch if task == "text" else args.batch,
            "rows": [{k: v for k, v in r.items() if k != "figure"} for r in rows]}


def study_cells(runs: list[dict], field: str) -> str:
    """Per seed (seed order), then mean ± sd."""
    values = [r[field] for r in sorted(runs, key=lambda r: r["seed"])]
    spread = lm_scaling.spread(values)
    return ", ".join(f"{v:.3f}" for v in values) + f" | {spread['mean']:.3f} ± {spread['sd']:.3f}"


def against_llama(runs: list[dict], llama: list[dict], field: str, what: str) -> str:
    """`runs` - `llama` per seed (paired: same seed, same batch order): mean ± sd [90% t interval]: verdict."""
    if not llama or runs == llama:
        return ""
    a, b = ([r[field] for r in sorted(group, key=lambda r: r["seed"])] for group in (runs, llama))
    if len(a) < 2:
        return ", ".join(f"{x - y:+.3f}" for x, y in zip(a, b))
    return f"{lm_scaling.paired_gap(a, b)}: {lm_scaling.gap_verdict(a, b, (what, 'Llama'))}"


def study_report(found: dict, args: argparse.Namespace, command: str) -> str:
    """The study's report.md, from `study`'s results."""
    task, rows, lrs, best = found["task"], found["rows"], found["lr"], found["best_init"]
    main = [r for r in rows if r["task"] == task]
    runs = lambda m, init: [r for r in main if r["model"] == m and r["init"] == init]
    names = [SHOWN[m] for m in args.models]
    shown = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    lines = [f"# {shown} on {task}, every initialisation with its own learning-rate sweep", "",
             f"Generated by `{command}`.", "",
             f"Every family at each initialisation of benchmarks/lm_scaling.py ({', '.join(args.inits)}), applied to "
             "all alike by the same code; for each family and initialisation the learning rate is picked from "
             f"{', '.join(f'{lr:g}' for lr in found['grid'])} by the final validation loss after {found['sweep_steps']}"
             f" steps ({args.sweep_fraction:.0%} of the budget, seed {args.seeds[0]}); then seeds "
             f"{', '.join(map(str, args.seeds))} at that rate, paired (same initialisation seed and batch order). "
             "Differences to Llama are per seed, mean ± sd and the 90% t interval of the mean. Each family's best "
             f"initialisation is the one with the best mean {STUDY_METRICS[task][0][1]}.", "",
             "## Learning-rate sweeps (final validation loss)", "",
             "| LR | " + " | ".join(f"{SHOWN[m]} {i}" for i in args.inits for m in args.models) + " |",
             "|---|" + "---|" * len(args.inits) * len(args.models)]
    for lr in found["grid"]:
        lines.append(f"| {lr:g} | " + " | ".join(f"{found['sweep'][i][m][f'{lr:g}']:.3f}" for i in args.inits
                                                 for m in args.models) + " |")
    edges = [f"{SHOWN[m]} {i}" for i in args.inits for m in args.models if lrs[i][m] in (min(found["grid"]),
                                                                                          max(found["grid"]))]
    lines += ["", f"The best learning rate is at the edge of the grid for {', '.join(edges)}."] if edges else []
    for field, title, _ in STUDY_METRICS[task]:
        lines += ["", f"## {title[0].upper() + title[1:]}, every family at every initialisation", "",
                  f"| initialisation | model | LR | {title} per seed | mean ± sd | - Llama, same initialisation |",
                  "|---|---|---|---|---|---|"]
        for init in args.inits:
            llama = runs("Transformer", init)
            lines += [f"| {init} | {SHOWN[m]} | {lrs[init][m]:g} | {study_cells(runs(m, init), field)} | "
                      f"{against_llama(runs(m, init), llama, field, SHOWN[m])} |" for m in args.models]
        lines += ["", f"Each family at its best initialisation (by {STUDY_METRICS[task][0][1]}), {title}:", "",
                  f"| model | initialisation | LR | {title} per seed | mean ± sd | - Llama, each at its best |",
                  "|---|---|---|---|---|---|"]
        llama = runs("Transformer", best["Transformer"]) if "Transformer" in best else []
        lines += [f"| {SHOWN[m]} | {best[m]} | {lrs[best[m]][m]:g} | {study_cells(runs(m, best[m]), field)} | "
                  f"{against_llama(runs(m, best[m]), llama, field, SHOWN[m])} |" for m in args.models]
    long = sorted((r for r in rows if r["task"] == "text-long"), key=lambda r: MODELS.index(r["model"]))
    if long:
        lines += ["", f"## The long run ({long[0]['steps']:,} steps, seed {long[0]['seed']}), each family at its best "
                  "initialisation", "", "| model | initialisation | LR | validation loss at the end | best along "
                  "training | step of the best |", "|---|---|---|---|---|---|"]
        lines += [f"| {SHOWN[r['model']]} | {r['init']} | {r['lr']:g} | {r['val_loss']:.3f} | {r['best_val_loss']:.3f}"
                  f" | {lowest_step(r):,} |" for r in long]
        lines += ["", long_run_reading(long, main, found["train_sequences"], found["batch"])]
    lines += ["", f"Run time, one process each on the CPU it ran on (no GPU figure): the {len(rows)} runs above "
              f"{sum(r['seconds'] for r in rows) / 3600:.2f} hours, the sweep runs {found['sweep_seconds'] / 3600:.2f} "
              "hours.", ""]
    return "\n".join(lines)


def lowest_step(row: dict) -> int:
    """The step of a run's lowest validation loss along training."""
    return min(row["curve"], key=lambda point: point["val_loss"])["step"]


def long_run_reading(long: list[dict], full: list[dict], sequences: int, batch: int) -> str:
    """What the long run can say: how many passes over the training blocks it makes, where its validation loss was
    lowest, and that one seed has no interval (the full runs' spread over seeds beside it)."""
    passes = lambda steps: f"{steps * batch / sequences:.1f}"
    lowest = sorted({lowest_step(r) for r in long})
    rose = sum(r["val_loss"] > r["best_val_loss"] for r in long)
    sds = [lm_scaling.spread([r["val_loss"] for r in full if (r["model"], r["init"]) == key])["sd"]
           for key in {(r["model"], r["init"]) for r in full}]
    return (f"{long[0]['steps']:,} steps of {batch} blocks are {passes(long[0]['steps'])} passes over the "
            f"{sequences:,} training blocks (the full runs' {full[0]['steps']:,} steps: {passes(full[0]['steps'])}). "
            f"The validation loss was lowest at step {' / '.join(f'{s:,}' for s in lowest)} "
            f"({' / '.join(passes(s) for s in lowest)} passes) and rose after it for {rose} of {len(long)} families: "
            "past that point the long run measures overfitting to a small file. One seed: no interval (the full runs' "
            f"sd over seeds is {min(sds):.3f} to {max(sds):.3f}).")


def run_study(args: argparse.Namespace, command: str) -> str:
    """`study` of one task, written to args.output_dir: report.md and results.json; `command` made it."""
    found = study(args)
    report = study_report(found, args, command)
    write_text(args.output_dir / "report.md", report)
    write_text(args.output_dir / "results.json", json.dumps({**found, "command": command}, indent=1))
    return report


def calibrate(args: argparse.Namespace) -> str:
    """Llama alone on the retrieval task for each needle count: the full experiment needs one where its accuracy is
    between the floor and the ceiling (0.2 to 0.8)."""
    lines = ["| needles N | queried R | steps | Transformer accuracy | val loss |", "|---|---|---|---|---|"]
    plan = [vars(args) | {"needles": n} for n in args.calibrate_needles]
    runs = [("retrieval", "Transformer", args.seeds[0], args.steps, argparse.Namespace(**p)) for p in plan]
    rows = list(run_all(runs, args.jobs))
    for unit in runs:
        partial_path(unit).unlink(missing_ok=True)
    for settings, row in zip(plan, rows):
        lines.append(f"| {settings['needles']} | {args.queries} | {args.steps} | {row['accuracy']:.3f} | "
                     f"{row['val_loss']:.3f} |")
    table = "\n".join(lines)
    write_text(args.output_dir / "calibration.md", f"settings: {vars(args)}\n\n{table}\n")
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/tinyshakespeare.txt"),
                        help="text file for the loss curves (skipped when missing)")
    parser.add_argument("--quick", action="store_true", help=f"toy size, for a smoke run: {QUICK}")
    parser.add_argument("--calibrate", action="store_true", help="train Llama alone for each --calibrate-needles")
    parser.add_argument("--calibrate-needles", type=int, nargs="+", default=[3])
    parser.add_argument("--tasks", nargs="+", choices=("retrieval", "text"), default=["retrieval", "text"])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=5000, help="training steps of the retrieval runs")
    parser.add_argument("--batch", type=int, default=32, help="batch of the retrieval runs")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the retrieval runs")
    parser.add_argument("--schedule", choices=("cosine", "wsd"), default="cosine", help="of the retrieval runs")
    parser.add_argument("--text-steps", type=int, default=800, help="training steps of the text runs")
    parser.add_argument("--long-steps", type=int, default=3200, help="steps of the long text run (0: none)")
    parser.add_argument("--text-batch", type=int, default=16)
    parser.add_argument("--text-lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2, help="DIFF heads h; DiffLlama and Llama have 2h")
    parser.add_argument("--context", type=int, default=56, help="retrieval haystack and question, in tokens")
    parser.add_argument("--needles", type=int, default=3, help="needles N per haystack (see --calibrate)")
    parser.add_argument("--queries", type=int, default=1, help="queried needles R per haystack")
    parser.add_argument("--digits", type=int, default=3, help="digits of each magic number")
    parser.add_argument("--examples", type=int, default=8000, help="retrieval training sequences")
    parser.add_argument("--eval-samples", type=int, default=6, help="held-out prompts per depth along training; "
                        "four times as many at the end")
    parser.add_argument("--curve-points", type=int, default=6, help="evaluations along each run")
    parser.add_argument("--text-block", type=int, default=128, help="training sequence length on the text file")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--output-dir", type=Path, help=f"default: {OUTPUT_ROOT}/<task> per task (the committed "
                        f"reports and runs); --calibrate: {OUTPUT_ROOT}; --quick: {QUICK['output_dir']}")
    parser.add_argument("--from-saved", action="store_true", help="train nothing: recompute every reported number "
                        "from the runs' saved models (checksums checked) and write the same report")
    parser.add_argument("--init", choices=lm_scaling.INITS, default=lm_scaling.BASE_INIT,
                        help="initialisation of every family (benchmarks/lm_scaling.py's INITS; default llama)")
    parser.add_argument("--study", action="store_true", help="every family at every --inits, each with its own "
                        f"learning-rate sweep, then every seed; reports in {STUDY_ROOT}/<task> unless --output-dir "
                        "(then OUTPUT_DIR/<task>)")
    parser.add_argument("--inits", nargs="+", choices=lm_scaling.INITS, default=list(lm_scaling.INITS),
                        help="--study: the initialisations (default all)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, *lm_scaling.FULL["lrs"]],
                        help="--study: the learning rates swept on retrieval (default lm_scaling.py's grid and 5e-4 "
                        "below it: DIFF's pick sat on the grid's lower edge)")
    parser.add_argument("--text-lrs", type=float, nargs="+", default=lm_scaling.FULL["lrs"],
                        help="--study: the learning rates swept on text (default lm_scaling.py's grid)")
    parser.add_argument("--sweep-fraction", type=float, default=0.25, help="--study: a sweep run's share of the budget")
    if parser.parse_known_args(argv)[0].quick:  # explicit flags still override the quick defaults
        parser.set_defaults(**QUICK)
    return argparse.Namespace(**vars(parser.parse_args(argv)), figures=True)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.study:
        if "text" in args.tasks and not args.data.is_file():
            print(f"skipping the text experiment: {args.data} not found (pass --data FILE)")
            args.tasks = [t for t in args.tasks if t != "text"]
        root = args.output_dir or STUDY_ROOT  # --quick: its folder
        command = shlex.join(["python", "benchmarks/paper_small.py", *(sys.argv[1:] if argv is None else argv)])
        return "\n".join(run_study(argparse.Namespace(**{**vars(args), "tasks": [task], "output_dir": root / task}),
                                   command) for task in args.tasks)
    if args.output_dir is None and not args.calibrate:
        if "text" in args.tasks and not args.data.is_file() and args.tasks != ["text"]:
            print(f"skipping the text experiment: {args.data} not found (pass --data FILE)")
            args.tasks = [t for t in args.tasks if t != "text"]
        return "\n".join(experiment(argparse.Namespace(**{**vars(args), "tasks": [task],
                                                           "output_dir": OUTPUT_ROOT / task}))
                         for task in args.tasks)
    return experiment(args)


def experiment(args: argparse.Namespace) -> str:
    """Train (or load, or with --from-saved recompute) every run of `args` and write its report to args.output_dir."""
    start = time.monotonic()
    if args.calibrate:
        args.output_dir = args.output_dir or OUTPUT_ROOT
        table = calibrate(args)
        print(table)
        return table
    plan = [u + (args,) for u in units(args)]
    rows = [from_saved(u) for u in plan] if args.from_saved else run_or_load(plan, args.jobs)
    check_same_data(rows)
    report = write_outputs(rows, args)
    print(f"{report}\n(this call: {(time.monotonic() - start) / 60:.1f} min)")
    return report


if __name__ == "__main__":
    try:
        main()
    except SavedRunError as error:
        sys.exit(f"error: {error}")
