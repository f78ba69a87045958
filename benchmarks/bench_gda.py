"""Grouped differential attention (GDA, `num_noise_heads`) against the same model copy-expanded to plain DIFF and
against Llama of equal parameter count, on this machine's CPU, side by side in one run: prefill (a forward over
the prompt, no gradient) and one training step (forward, backward, AdamW step). Each is timed as the CPU time of
this process (one torch thread by default), which a shared machine's other load disturbs less than wall time;
timings are interleaved (round-robin over the models, order rotated every round) and the median of the rounds is
reported with its ratio to Llama.

The copy-expanded model has the GDA model's weights with each noise head's query rows copied over its group
(what `convert --expand-noise-heads` writes): the same outputs, more parameters, one noise softmax per head. Under
`eager` a GDA layer computes each noise map once (h + g softmaxes a layer instead of 2h); under `sdpa` the noise
branch makes one standard-attention call over the g noise heads (`standard_calls`; on CPU from 129 tokens with
d >= 32 `sdpa` takes the tiled kernel instead, which computes each noise map once in prefill and repeats the
noise queries over their groups when it needs gradients).

    python benchmarks/bench_gda.py            # hidden 640, 2 layers, 16 heads of 32, 4 noise heads, seq 384
    python benchmarks/bench_gda.py --quick    # a smoke run
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diff_transformer import DiffConfig, DiffForCausalLM  # noqa: E402
from diff_transformer.attention_kernels import GROUPED_KERNELS, diff_attention, select_kernel  # noqa: E402


SIZES = {  # option: (default, meaning)
    "hidden": (640, "hidden size, a multiple of (h + g) d (Llama's heads)"), "heads": (16, "differential heads h"),
    "noise": (4, "noise heads g = kv heads"), "head-dim": (32, "d (dv = 2d)"), "intermediate": (1792, "GDA's MLP"),
    "layers": (2, "layers"), "vocab": (4096, "vocabulary"), "seq": (384, "tokens per sequence"),
    "batch": (1, "sequences"), "rounds": (5, "timed rounds after a warm-up"), "threads": (1, "torch threads"),
}


def diff_config(args: argparse.Namespace, noise: int | None) -> DiffConfig:
    """The GDA shape of Motif-2-12.7B scaled down: h differential heads of d, dv = 2d, h_kv = g kv heads."""
    return DiffConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, head_dim=args.head_dim,
                      num_key_value_heads=args.noise, num_noise_heads=noise, max_position_embeddings=args.seq,
                      embedding_multiplier=1.0)


def expanded_state(gda: DiffForCausalLM) -> dict[str, torch.Tensor]:
    """The GDA model's weights with each noise head's q rows copied to the heads of its group."""
    config, state = gda.config, dict(gda.state_dict())
    h, d, group = config.num_attention_heads, config.head_dim, config.noise_group_size
    for key, value in state.items():
        if key.endswith("q_proj.weight"):
            noise = value[h * d:].view(-1, d, value.shape[-1]).repeat_interleave(group, dim=0).reshape(h * d, -1)
            state[key] = torch.cat([value[: h * d], noise])
    return state


def llama_of_equal_size(args: argparse.Namespace, target: int) -> LlamaForCausalLM:
    """Llama with h + g heads of d (the GDA model's query heads), g kv heads, and the MLP width that brings its
    parameter count closest to `target`."""
    def build(intermediate: int) -> LlamaForCausalLM:
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.heads + args.noise, head_dim=args.head_dim,
            num_key_value_heads=args.noise, max_position_embeddings=args.seq))

    base = build(args.intermediate).num_parameters()
    per_unit = 3 * args.hidden * args.layers  # gate, up and down rows/columns per intermediate unit
    return build(args.intermediate + round((target - base) / per_unit))


def models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    gda = DiffForCausalLM(diff_config(args, args.noise))
    expanded = DiffForCausalLM(diff_config(args, None))
    expanded.load_state_dict(expanded_state(gda))
    built = {}
    for backend in ("eager", "sdpa"):
        for name, model in (("GDA", gda), ("expanded", expanded)):
            built[f"{name} {backend}"] = twin = type(model)._from_config(copy.deepcopy(model.config),
                                                                         attn_implementation=backend)
            twin.load_state_dict(model.state_dict())
    built["Llama sdpa"] = llama_of_equal_size(args, gda.num_parameters())
    built["Llama sdpa"].set_attn_implementation("sdpa")
    return built


def prefill(model: torch.nn.Module, batch: torch.Tensor) -> float:
    start = time.process_time()
    with torch.no_grad():
        model(batch, use_cache=False)
    return time.process_time() - start


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    start = time.process_time()
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.process_time() - start


def measure(built: dict[str, torch.nn.Module], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median CPU seconds of prefill and of a training step per model, over interleaved rounds after a warm-up."""
    batch = torch.randint(3, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in built.items()}
    times = {name: {"prefill": [], "train": []} for name in built}
    names = list(built)
    for round_index in range(args.rounds + 1):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            built[name].eval()
            step_prefill = prefill(built[name], batch)
            built[name].train()
            step_train = train_step(built[name], optimizers[name], batch)
            if round_index:  # round 0 warms up
                times[name]["prefill"].append(step_prefill)
                times[name]["train"].append(step_train)
    return {name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in times.items()}


def attention_inputs(layer: torch.nn.Module, args: argparse.Namespace) -> list[torch.Tensor]:
    """Seeded q, k, v of one layer at the benchmark's shapes (the layer's projections' layout), requiring grad."""
    generator = torch.Generator().manual_seed(2)
    if isinstance(layer, LlamaAttention):
        heads, kv_heads, width = layer.config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim
        shapes = [(heads, width), (kv_heads, width), (kv_heads, width)]
    else:
        kv_heads, d = layer.num_key_value_heads, layer.head_dim
        shapes = [(layer.num_heads + layer.num_noise_heads, d), (kv_heads, 2 * d), (kv_heads, layer.value_head_dim)]
    return [torch.randn(args.batch, heads, args.seq, width, generator=generator).requires_grad_()
            for heads, width in shapes]


def attention_call(layer: torch.nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    """One causal attention call of `layer`'s kernel (its backend's)."""
    if isinstance(layer, LlamaAttention):
        return sdpa_attention_forward(layer, *inputs, None, scaling=layer.scaling)[0]
    return diff_attention(layer, *inputs, torch.tensor(0.3), None, layer.scaling)[0]


def attention_step(layer: torch.nn.Module, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """CPU seconds of one attention call without gradients (prefill's), and of one with its backward."""
    start = time.process_time()
    with torch.no_grad():
        attention_call(layer, inputs)
    middle = time.process_time()
    attention_call(layer, inputs).sum().backward()
    return middle - start, time.process_time() - middle


def attention_times(built: dict[str, torch.nn.Module], args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Median CPU seconds of the first layer's attention kernel per model, interleaved: (forward without
    gradients, forward and backward)."""
    layers = {name: model.model.layers[0].self_attn for name, model in built.items()}
    inputs = {name: attention_inputs(layer, args) for name, layer in layers.items()}
    times = {name: [] for name in layers}
    for round_index in range(args.rounds + 1):
        for name, layer in layers.items():
            elapsed = attention_step(layer, inputs[name])
            if round_index:
                times[name].append(elapsed)
    return {name: tuple(statistics.median(run[i] for run in runs) for i in range(2)) for name, runs in times.items()}


def kernel_and_softmaxes(model: torch.nn.Module, args: argparse.Namespace) -> tuple[str, str]:
    """The attention kernel a layer runs at the benchmark's shapes and the softmax maps [T, S] it computes per
    sequence, in prefill and in a training step: h + g where the kernel computes each noise map once
    (`GROUPED_KERNELS`; the tiled kernel without gradients only), else 2h (Llama: its heads)."""
    config = model.config
    if not isinstance(model, DiffForCausalLM):
        return "sdpa", str(config.num_attention_heads)
    layer = model.model.layers[0].self_attn
    name = select_kernel(config._attn_implementation, *attention_inputs(layer, args))
    heads, noise = config.num_attention_heads, config.num_noise_heads
    grouped_prefill = name in GROUPED_KERNELS
    grouped_train = grouped_prefill and name != "tiled"
    prefill, train = (heads + (noise if grouped else heads) for grouped in (grouped_prefill, grouped_train))
    return name, str(prefill) if prefill == train else f"{prefill} / {train}"


def table(built: dict[str, torch.nn.Module], results: dict[str, dict[str, float]],
          attention: dict[str, float], args: argparse.Namespace) -> str:
    llama, rows = results["Llama sdpa"], [
        "| model | parameters | kernel | softmax maps / layer (prefill / train) | prefill s | train step s | "
        "attention fwd s | attention fwd+bwd s | prefill / Llama | train / Llama | attention fwd / Llama | "
        "attention fwd+bwd / Llama |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = attention["Llama sdpa"]
    for name, model in built.items():
        result, (kernel, maps), (forward, both) = results[name], kernel_and_softmaxes(model, args), attention[name]
        rows.append(f"| {name} | {model.num_parameters():,} | {kernel} | {maps} | "
                    f"{result['prefill']:.3f} | {result['train']:.3f} | {forward:.4f} | {both:.4f} | "
                    f"{result['prefill'] / llama['prefill']:.2f} | {result['train'] / llama['train']:.2f} | "
                    f"{forward / base[0]:.2f} | {both / base[1]:.2f} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, meaning) in SIZES.items():
        parser.add_argument(f"--{name}", type=int, default=default, help=meaning)
    parser.add_argument("--quick", action="store_true", help="hidden 160, h 4, g 1, 2 layers, seq 64, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.noise, args.intermediate = 160, 4, 1, 320
        args.layers, args.seq, args.rounds, args.vocab = 2, 64, 2, 512
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    built = models(args)
    print(f"hidden {args.hidden}, {args.layers} layers, h {args.heads} x d {args.head_dim} (dv {2 * args.head_dim}), "
          f"g = h_kv = {args.noise}, seq {args.seq}, batch {args.batch}, fp32, {args.threads} thread(s), CPU seconds, "
          f"median of {args.rounds} rounds")
    print(table(built, measure(built, args), attention_times(built, args), args))


if __name__ == "__main__":
    main()
