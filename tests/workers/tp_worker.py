"""Tensor-parallel run of saved models; used by tests/test_tensor_parallel.py.

    torchrun --nproc_per_node 2 tests/workers/tp_worker.py OUTPUT_DIR MODEL_DIR [MODEL_DIR ...]

Loads each folder with `from_pretrained(folder, tp_plan="auto")` and reports `measure` of it per rank, with the
rank's local shards of the attention weights. `measure` of the unsharded model is the single-process reference.
"""

import sys
from pathlib import Path

import torch
from results import finish
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from diff_transformer.input_checks import CACHE_KWARG  # importing the package registers the Auto classes

# Two micro-batches of two rows; the second row of the first is left-padded, so masks are sharded too.
MICRO_BATCHES = [
    torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)
]
PADDING = torch.tensor([[1] * 12, [0] * 3 + [1] * 9])
NEW_TOKENS = 8


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def measure(model) -> dict:
    """Logits and per-layer cache heads of the first micro-batch, the loss of each micro-batch, the gradients summed
    over both (gradient accumulation), and greedy tokens with a dynamic and a static cache (chunked prefill: the
    static cache is allocated up front, in `_get_static_cache_init_shape`'s shapes)."""
    ids = MICRO_BATCHES[0]
    with torch.no_grad():
        out = model(ids, attention_mask=PADDING, use_cache=True)
    cache = getattr(out, CACHE_KWARG)
    losses = []
    for batch in MICRO_BATCHES:
        loss = model(batch, attention_mask=PADDING, labels=batch.masked_fill(PADDING == 0, -100)).loss
        loss.backward()
        losses.append(loss.item())
    greedy = dict(attention_mask=PADDING, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        tokens = model.generate(ids, **greedy)
        static_tokens = model.generate(ids, **greedy, cache_implementation="static", prefill_chunk_size=4)
    return {
        "logits": out.logits.tolist(),
        "cache_heads": [layer.keys.shape[1] for layer in cache.layers],
        "losses": losses,
        "grads": {name: whole(p.grad).tolist() for name, p in model.named_parameters()},
        "tokens": tokens.tolist(),
        "static_tokens": static_tokens.tolist(),
    }


def local_attention_weights(model) -> dict:
    """This rank's shard of every attention parameter."""
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).tolist()
        for name, p in model.named_parameters()
        if ".self_attn." in name
    }


def main() -> None:
    torch.set_num_threads(1)
    output_dir, folders = sys.argv[1], sys.argv[2:]
    results = {}
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
        results[Path(folder).name] = {**measure(model), "shards": local_attention_weights(model)}
    finish(output_dir, results)


if __name__ == "__main__":
    main()
