"""Quantization as users meet it: transformers' CPU-capable quantization integrations (torchao, optimum-quanto,
bitsandbytes) on saved DIFF models beside Llama, loaded with `from_pretrained(folder, quantization_config=...)`, and
llm-compressor's one-shot W8A8 and GPTQ W4A16, saved as compressed-tensors folders and loaded again.

Three modes:

    python benchmarks/quantization.py --tiny     # tiny random DIFF V1, V2, hybrid and Llama: which methods run
    python benchmarks/quantization.py --data tinyshakespeare.txt benchmarks/paper_small/text/runs/text-*.model
                                                 # trained models: held-out loss increase per method
    python benchmarks/quantization.py --lm-scaling
                                                 # the single-epoch benchmark's models, each family at its best
                                                 # initialisation, every seed (trained again and kept, ~30 min)

Per model and method: the held-out loss before and after (the mean next-token loss over validation blocks of the
text, cut as benchmarks/paper_small.py cuts it: 90% train, the last 10% held out; --lm-scaling: that benchmark's own
validation blocks; --tiny: random token ids), how
many of the model's Linear layers the method replaced, and whether greedy `generate` runs. A method whose library is
not installed is skipped with its name and the install command; one that fails says how, in one line. CPU only.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM,
                          QuantoConfig, TorchAoConfig)

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.tools.data import text_file_dataset
from diff_transformer.tools.safe_write import write_text


def torchao_config(name: str) -> Callable[[], TorchAoConfig]:
    def make() -> TorchAoConfig:
        import torchao.quantization as quantization

        return TorchAoConfig(getattr(quantization, name)())
    return make


# name -> (the library it needs, its install command, the quantization config)
METHODS: dict[str, tuple[str, str, Callable]] = {
    "torchao int8 weight-only": ("torchao", "pip install torchao", torchao_config("Int8WeightOnlyConfig")),
    "torchao int8 dynamic activation": ("torchao", "pip install torchao",
                                        torchao_config("Int8DynamicActivationInt8WeightConfig")),
    "torchao int4 weight-only": ("torchao", "pip install torchao", torchao_config("Int4WeightOnlyConfig")),
    "quanto int8": ("optimum.quanto", "pip install optimum-quanto", lambda: QuantoConfig(weights="int8")),
    "quanto int4": ("optimum.quanto", "pip install optimum-quanto", lambda: QuantoConfig(weights="int4")),
    "bitsandbytes 8-bit": ("bitsandbytes", "pip install bitsandbytes", lambda: BitsAndBytesConfig(load_in_8bit=True)),
    "bitsandbytes 4-bit nf4": ("bitsandbytes", "pip install bitsandbytes",
                               lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")),
    "llm-compressor W8A8": ("llmcompressor", "pip install llmcompressor", lambda: llm_compressor_recipe("W8A8")),
    "llm-compressor GPTQ W4A16": ("llmcompressor", "pip install llmcompressor",
                                  lambda: llm_compressor_recipe("GPTQ W4A16")),
}
# Methods that quantize a model with calibration data and save it (compressed-tensors), loaded again to be measured.
SAVED = ("llm-compressor W8A8", "llm-compressor GPTQ W4A16")
GROUP_SIZE = 16  # GPTQ's groups: the widths here (96, 128, 256, 336) are multiples of 16, not all of 128
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=2,
            tie_word_embeddings=True)
TINY_MODELS = {"DIFF V1": dict(), "DIFF V2": dict(diff_version=2, num_attention_heads=4),
               "DIFF hybrid": dict(attention_types=["differential", "standard"]), "Llama": None}


def missing_library(method: str) -> str | None:
    """Why `method` cannot run here (its library is not installed, with the command), None when it can."""
    import importlib.util

    module, install, _ = METHODS[method]
    found = importlib.util.find_spec(module.split(".")[0]) is not None and importlib.util.find_spec(module)
    return None if found else f"{module} not installed (`{install}`)"


def save_tiny_models(folder: Path) -> dict[str, Path]:
    """Tiny random models, seed 0, saved as from_pretrained folders: {name: folder}."""
    out = {}
    for name, extra in TINY_MODELS.items():
        torch.manual_seed(0)
        if extra is None:
            model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_attention_heads": 4, "head_dim": 32}))
        else:
            model = DiffForCausalLM(DiffConfig(**{**TINY, **extra}))
        out[name] = folder / name.replace(" ", "-")
        model.save_pretrained(out[name])
    return out


def held_out_loss(model, blocks: torch.Tensor) -> float:
    """Mean next-token loss over `blocks` [N, T], 8 at a time."""
    with torch.no_grad():
        return statistics.mean(model(chunk, labels=chunk).loss.item() for chunk in blocks.split(8))


def llm_compressor_recipe(scheme: str):
    """llm-compressor's modifier for `scheme`: W8A8 (int8 weights per channel, int8 activations per token, dynamic)
    or GPTQ W4A16 (int4 weights in groups of GROUP_SIZE, GPTQ's error compensation); the head stays unquantized, as
    llm-compressor's examples leave it."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if scheme == "W8A8":
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE}
    return GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"])


def byte_tokenizer():
    """A tokenizer whose ids are byte values, for folders without one (llm-compressor asks for a processor; the
    calibration ids are given to it already tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"<0x{i:02X}>": i for i in range(256)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="<0x00>")),
                                   pad_token="<0x00>")


def compressed_folder(folder: Path, method: str, calibration: torch.Tensor, out: Path) -> Path:
    """llm-compressor's one-shot `method` on the model of `folder`, calibrated on `calibration` [N, T], saved
    compressed (compressed-tensors) in `out`."""
    from datasets import Dataset
    from llmcompressor import oneshot

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer.json").is_file() else byte_tokenizer()
    data = Dataset.from_dict({"input_ids": calibration.tolist(),
                             "attention_mask": torch.ones_like(calibration).tolist()})
    oneshot(model=model, dataset=data, recipe=METHODS[method][2](), processor=tokenizer, output_dir=str(out),
            num_calibration_samples=len(calibration), max_seq_length=calibration.shape[1])
    return out


def quantized_linears(model) -> str:
    """'n of N': the Linear layers whose weight the method replaced (a tensor subclass or another module) or that
    carry a quantization scheme (compressed-tensors)."""
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    changed = [m for m in linears if type(m) is not torch.nn.Linear or type(m.weight) is not torch.nn.Parameter
               or getattr(m, "quantization_scheme", None) is not None]
    return f"{len(changed)} of {len(linears)}"


def quantized_model(folder: Path, method: str, calibration: torch.Tensor, tmp: Path):
    """The model of `folder` quantized by `method`: at load (`quantization_config`), or saved by llm-compressor and
    loaded again."""
    if method in SAVED:
        return AutoModelForCausalLM.from_pretrained(compressed_folder(folder, method, calibration, tmp / "saved"),
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=METHODS[method][2](), device_map="cpu",
                                                dtype=torch.float32).eval()


def try_method(folder: Path, method: str, blocks: torch.Tensor, calibration: torch.Tensor) -> dict:
    """One method on one saved model: {"loss", "linears", "generate", "seconds"}, or {"skipped": why} / {"error"}."""
    if reason := missing_library(method):
        return {"skipped": reason}
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = quantized_model(folder, method, calibration, Path(tmp))
            loss = held_out_loss(model, blocks)
            tokens = model.generate(blocks[:1, :8], max_new_tokens=4, do_sample=False)
    except Exception as error:  # a method that fails is a result: reported in one line, the others still run
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"}
    return {"loss": loss, "linears": quantized_linears(model), "generate": tuple(tokens.shape) == (1, 12),
            "seconds": round(time.monotonic() - start, 1)}


def measure(folder: Path, blocks: torch.Tensor, methods: list[str], calibration: torch.Tensor) -> dict:
    """{"none": loss unquantized, method: `try_method`} for one saved model; `calibration` [N, T]: training blocks
    for the methods that calibrate."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # saved in bf16 or fp32
    return {"none": held_out_loss(model, blocks), **{m: try_method(folder, m, blocks, calibration) for m in methods}}


def cell(result: dict, base: float) -> str:
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    if "error" in result:
        return f"fails: {result['error']}"
    finite = math.isfinite(result["loss"])
    return (f"{result['loss'] - base:+.4f} ({result['linears']} linears; generate "
            f"{'runs' if result['generate'] else 'wrong shape'})" if finite else "loss not finite")


def table(results: dict[str, dict], methods: list[str]) -> str:
    """Markdown: one row per model, its loss unquantized, then each method's loss increase."""
    lines = ["| model | loss | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for name, found in results.items():
        lines.append(f"| {name} | {found['none']:.4f} | " + " | ".join(cell(found[m], found["none"]) for m in methods)
                     + " |")
    return "\n".join(lines)


def mean_increase(results: dict[str, dict], methods: list[str]) -> str:
    """Markdown: per family (the folder name's model, as paper_small names its runs) and method, the mean ± sd loss
    increase over the saved models of that family."""
    families = sorted({name.split("-")[1] for name in results}, key=lambda f: (f == "Transformer", f))
    lines = ["| family | models | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for family in families:
        runs = [found for name, found in results.items() if name.split("-")[1] == family]
        cells = []
        for method in methods:
            values = [r[method]["loss"] - r["none"] for r in runs if "loss" in r[method]]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.mean(values):+.4f} ± {spread:.4f}" if values else "-")
        shown = "Llama" if family == "Transformer" else family
        lines.append(f"| {shown} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sibling(name: str):
    """The benchmark script `name`.py beside this one, as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_scaling_models(models_dir: Path, corpus_dir: Path, count: int) -> tuple[dict[str, Path], torch.Tensor,
                                                                               torch.Tensor, list[str]]:
    """The single-epoch benchmark's reported runs (benchmarks/lm_scaling/results.json: each family at its best
    initialisation and learning rate, every seed) trained again by its own `train_run` with the final model saved in
    `models_dir` (kept, so a second call trains nothing), its validation blocks, the first `count` training blocks
    (calibration) and one line per model on how close the retrained run came to the stored final validation loss."""
    lm_scaling = sibling("lm_scaling")
    results = json.loads((Path(__file__).with_name("lm_scaling") / "results.json").read_text())
    cfg = results["config"]
    _, train, val = lm_scaling.load_blocks(cfg, corpus_dir, fetch=True)
    folders, lines = {}, []
    for family, seeds in results["runs"]["main"].items():
        for seed, run in seeds.items():
            settings = run["settings"]
            init = settings.get("init", lm_scaling.BASE_INIT)
            name = f"lm_scaling-{family}-{init}-seed{seed}"
            folder = models_dir / f"{name}-{lm_scaling.run_path(Path(), settings).stem.rsplit('-', 1)[1]}"
            if not (folder / "config.json").is_file():
                lm_scaling.train_run(family, cfg, settings["lr"], settings["seed"], settings["steps"], train, val,
                                     init, save_to=folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            now, stored = lm_scaling.validation_loss(model, val), run["curve"][-1]["val_loss"]
            lines.append(f"{name}: validation loss {now:.5f} here, {stored:.5f} stored ({now - stored:+.1e})")
            folders[name] = folder
    return folders, val, train[:count], lines


def paired_increase(results: dict[str, dict], methods: list[str]) -> str:
    """Markdown: per method, DIFF's loss increase minus Llama's, seed by seed (the single-epoch benchmark pairs
    seeds): mean ± sd and the 90% t interval of the mean, and what the interval says."""
    lm_scaling = sibling("lm_scaling")
    lines = ["| method | DIFF - Llama, loss increase (per seed) | mean ± sd | 90% interval | reading |",
             "|---|---|---|---|---|"]
    for method in methods:
        increase = {family: [r[method]["loss"] - r["none"] for name, r in sorted(results.items())
                             if name.split("-")[1] == family and "loss" in r[method]] for family in ("DIFF", "Llama")}
        if not increase["DIFF"] and not increase["Llama"]:
            lines.append(f"| {method} | - | - | - | fails (or skipped) on every model of both families |")
            continue
        if len(increase["DIFF"]) != len(increase["Llama"]) or len(increase["DIFF"]) < 2:
            lines.append(f"| {method} | - | - | - | measured on some models only: see the table above |")
            continue
        gap = lm_scaling.paired(increase["DIFF"], increase["Llama"])
        low, high = gap["t90"]
        reading = lm_scaling.verdict(low <= 0 <= high, high < 0, "DIFF loses less", "DIFF loses more")
        lines.append(f"| {method} | {', '.join(f'{g:+.4f}' for g in gap['per_seed'])} | {gap['mean']:+.4f} ± "
                     f"{gap['sd']:.4f} | [{low:+.4f}, {high:+.4f}] | {reading} |")
    return "\n".join(lines)


def text_blocks(folder: Path, data: Path, block: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out, calibration): `data` cut as benchmarks/paper_small.py cuts it (the last 10% held out), with the
    folder's own tokenizer; the first `count` blocks of each part."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = text_file_dataset(data, tokenizer, block)
    blocks = torch.stack([ids[i]["input_ids"] for i in range(len(ids))])
    return blocks[int(0.9 * len(blocks)):][:count], blocks[:count]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", type=Path, help="saved models (from_pretrained folders with a tokenizer)")
    parser.add_argument("--tiny", action="store_true", help="tiny random DIFF V1, V2, hybrid and Llama instead")
    parser.add_argument("--lm-scaling", action="store_true",
                        help="the single-epoch benchmark's reported models (benchmarks/lm_scaling), trained again and "
                             "kept in --models-dir")
    parser.add_argument("--models-dir", type=Path,
                        default=Path.home() / ".cache" / "diff-transformer" / "lm_scaling-models")
    parser.add_argument("--corpus-dir", type=Path, default=Path.home() / ".cache" / "diff-transformer" / "corpus",
                        help="where benchmarks/lm_scaling.py keeps its corpus")
    parser.add_argument("--data", type=Path, help="the text the folders' models were trained on (held-out loss)")
    parser.add_argument("--block", type=int, default=128, help="tokens per block (paper_small's --text-block)")
    parser.add_argument("--blocks", type=int, default=32,
                        help="held-out blocks scored, and training blocks calibrating (--lm-scaling: all 64 "
                             "validation blocks are scored)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--output", type=Path, help="also write the report (with the command and versions) here")
    args = parser.parse_args(argv)
    if args.tiny + args.lm_scaling + bool(args.folders) != 1:
        parser.error("give saved model folders (with --data), --tiny or --lm-scaling: one of them")
    if args.folders and (args.data is None or not args.data.is_file()):
        parser.error(f"--data: the text file the models were trained on is needed for held-out loss ({args.data})")
    if missing := [f for f in args.folders if not (f / "config.json").is_file()]:
        parser.error(f"not a saved model folder (no config.json): {missing[0]}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            folders = save_tiny_models(Path(tmp))
            ids = torch.randint(0, TINY["vocab_size"], (16, 64), generator=torch.Generator().manual_seed(0))
            calibration = torch.randint(0, TINY["vocab_size"], (16, 64), generator=torch.Generator().manual_seed(1))
            results = {name: measure(folder, ids, args.methods, calibration) for name, folder in folders.items()}
            report = table(results, args.methods)
        elif args.lm_scaling:
            folders, val, calibration, checks = lm_scaling_models(args.models_dir, args.corpus_dir, args.blocks)
            results = {name: measure(folder, val, args.methods, calibration) for name, folder in folders.items()}
            report = ("Each model retrained from its stored settings; its validation loss against the stored run's:\n\n"
                      + "\n".join(f"- {line}" for line in checks) + "\n\n" + table(results, args.methods)
                      + "\n\nMean ± sd over the seeds of each family:\n\n" + mean_increase(results, args.methods)
                      + "\n\nPaired by seed (same initialisation seed and batch order):\n\n"
                      + paired_increase(results, args.methods))
        else:
            results = {}
            for folder in args.folders:
                held_out, calibration = text_blocks(folder, args.data, args.block, args.blocks)
                results[folder.name.removesuffix(".model")] = measure(folder, held_out, args.methods, calibration)
            report = table(results, args.methods) + "\n\nMean ± sd over the saved models of each family:\n\n" + \
                mean_increase(results, args.methods)
    print(report)
    if args.output:
        write_text(args.output, f"Generated by `{shlex.join(['python', 'benchmarks/quantization.py', *sys.argv[1:]])}`"
                                f" ({versions()}; one thread, CPU).\n\n{report}\n")
    return report


def versions() -> str:
    """The versions of the libraries the results depend on."""
    found = []
    for name in ("torch", "transformers", "torchao", "optimum-quanto", "bitsandbytes", "llmcompressor",
                 "compressed-tensors"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
