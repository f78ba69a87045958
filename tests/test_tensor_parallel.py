"""Tensor parallelism: `from_pretrained(tp_plan="auto")` on 2 processes against one (not in the floor pass).

`from_pretrained(folder, tp_plan="auto")` on 2 CPU processes (torchrun, gloo) gives one process's logits, losses,
accumulated gradients (gathered) and greedy tokens (dynamic and static cache), and each rank holds the rows of
docs/design.md §8: whole differential heads. MHA and GQA; V1, V2 and a hybrid stack; Llama as the control."""

from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from helpers.multiprocess import torchrun
from transformers import AutoModelForCausalLM, DistributedConfig, LlamaConfig, LlamaForCausalLM
from workers import tp_worker

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.diff_tensor_parallel import branch_halves_rank_major

TP = 2
# fp32. The rowwise projections (o_proj, down_proj) add two partial products across the processes: the same sums
# in another order. Measured over every case under transformers 5.17 and 5.24: logits (up to 0.58) max abs diff
# 2.4e-7, losses 4.8e-7 on 4.6, gradients (up to 0.37) 1.2e-7. A wrong shard moves them by 1e-3 and more.
LOGITS_ATOL, LOGITS_RTOL = 2e-6, 1e-5
LOSS_RTOL = 1e-6
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-5

HEADS = {
    "MHA": dict(num_attention_heads=4, num_key_value_heads=4),
    "GQA": dict(num_attention_heads=4, num_key_value_heads=2),
}
STACKS = {
    "V1": dict(),
    "V2": dict(diff_version=2),
    "hybrid": dict(attention_types=["differential", "standard"], attention_bias=True),
}
# The default suite's case: V1 with GQA, and q/k/v biases (a converted Qwen2's), whose halves shard like the weights.
FAST_CASE = "V1-GQA-bias"
CASES = {
    FAST_CASE: dict(**HEADS["GQA"], attention_bias=True),
    **{f"{stack}-{heads}": {**STACKS[stack], **HEADS[heads]} for stack in STACKS for heads in HEADS if stack != "V1"},
    "V1-MHA": HEADS["MHA"],
}
LLAMA = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0,
)


def save(case: str, root: Path) -> Path:
    """A seeded tiny model of `case` (or Llama), saved under root/case, with random biases. The vocabulary divides by
    TP: transformers 5.17 gathers lm_head's output only over equal shards."""
    torch.manual_seed(0)
    if case == "llama":
        model = LlamaForCausalLM(LLAMA)
    else:
        model = DiffForCausalLM._from_config(tiny_config(vocab_size=96, **CASES[case]), attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)  # initialised to zero, where a wrong shard would go unnoticed
    model.save_pretrained(root / case)
    return root / case


def rows(rank: int, *blocks: int) -> torch.Tensor:
    """The indices of the rank's 1/TP of each of consecutive blocks of `blocks` rows: heads [r H/n, (r+1) H/n) of a
    block of H heads."""
    starts = torch.tensor([0, *blocks]).cumsum(0)
    return torch.cat([torch.arange(s + rank * n // TP, s + (rank + 1) * n // TP) for s, n in zip(starts, blocks)])


def held(config, name: str, rank: int) -> tuple[int, torch.Tensor] | None:
    """(dim, indices) of parameter `name` (of one layer's self_attn) that a rank holds per docs/design.md §8, or None
    for a whole parameter."""
    layer = int(name.split(".")[2])
    module = name.split(".")[4]
    d = config.head_dim
    if isinstance(config, LlamaConfig) or config.attention_types[layer] == "standard":
        widen = 1 if isinstance(config, LlamaConfig) else config.value_head_dim // d
        h, h_kv = config.num_attention_heads * widen, config.num_key_value_heads * widen
        blocks = {"q_proj": (h * d,), "k_proj": (h_kv * d,), "v_proj": (h_kv * d,), "o_proj": (h * d,)}
    elif config.diff_version == 2:
        h, h_kv = config.num_attention_heads, config.num_key_value_heads
        blocks = {"q_proj": (2 * h * d,), "k_proj": (h_kv * d,), "v_proj": (h_kv * d,), "o_proj": (h * d,)}
        blocks["lambda_proj"] = (h,)
    else:
        h, h_kv, dv = config.num_attention_heads, config.num_key_value_heads, config.value_head_dim
        blocks = {"q_proj": (h * d, h * d), "k_proj": (h_kv * d, h_kv * d), "v_proj": (h_kv * dv,), "o_proj": (h * dv,)}
    if module not in blocks or (module == "o_proj" and name.endswith("bias")):
        return None  # lambda_params, subln: whole
    return (1 if module == "o_proj" else 0), rows(rank, *blocks[module])


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_rank_major_order_gives_each_block_the_rows_of_diff_colwise(ranks: int):
    """vLLM shards a projection by contiguous blocks of rows; loaded in `branch_halves_rank_major` order, block r is
    what `diff_colwise` gives rank r (docs/design.md §8, `rows`): both halves' r-th slice, with a weight's columns."""
    half = 4 * ranks  # rows per branch
    weight = torch.arange(2 * half * 3).view(2 * half, 3)  # [branch-1 rows | branch-2 rows] x 3 columns
    blocks = branch_halves_rank_major(weight, ranks).chunk(ranks)
    for rank, block in enumerate(blocks):
        expected = torch.cat([weight[rank * half // ranks:(rank + 1) * half // ranks],
                              weight[half + rank * half // ranks:half + (rank + 1) * half // ranks]])
        assert torch.equal(block, expected), f"rank {rank} of {ranks}: {block[:, 0].tolist()}"
    if ranks == TP:
        assert torch.equal(torch.cat(blocks)[:, 0] // 3, torch.cat([rows(r, half, half) for r in range(TP)]))


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_rank_major_order_of_grouped_noise_heads(ranks: int):
    """Grouped noise heads: branch 1 has 4 rows per branch-2 row; block r holds branch 1's r-th slice, then branch 2's
    r-th slice (the noise heads of rank r's differential heads), as the vLLM loader cuts q_proj."""
    signal, noise = 8 * ranks, 2 * ranks
    weight = torch.arange((signal + noise) * 3).view(signal + noise, 3)
    blocks = branch_halves_rank_major(weight, ranks, signal).chunk(ranks)
    for rank, block in enumerate(blocks):
        expected = torch.cat([weight[rank * 8:(rank + 1) * 8], weight[signal + rank * 2:signal + (rank + 1) * 2]])
        assert torch.equal(block, expected), f"rank {rank} of {ranks}: {block[:, 0].tolist()}"


def close(actual, expected, atol: float, rtol: float, what: str) -> None:
    actual, expected = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    diff = (actual - expected).abs()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool((diff <= atol + rtol * expected.abs()).all()), (
        f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e} (atol={atol}, rtol={rtol})"
    )


def check_against_one_process(folder: Path, ranks: list[dict]) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = tp_worker.measure(model)
    weights = dict(model.named_parameters())
    for rank, actual in enumerate(ranks):
        where = f"{folder.name}, rank {rank}"
        close(actual["logits"], expected["logits"], LOGITS_ATOL, LOGITS_RTOL, f"{where}: logits")
        close(actual["losses"], expected["losses"], 0, LOSS_RTOL, f"{where}: losses")
        for name, grad in expected["grads"].items():
            close(actual["grads"][name], grad, GRAD_ATOL, GRAD_RTOL, f"{where}: gradient of {name}")
        for key in ("tokens", "static_tokens"):
            assert actual[key] == expected[key] == expected["tokens"], (
                f"{where}: {key} {actual[key]}, one process {expected[key]} (dynamic cache {expected['tokens']})"
            )
        local_heads = [count // TP for count in expected["cache_heads"]]
        assert actual["cache_heads"] == local_heads, f"{where}: cache heads {actual['cache_heads']} != {local_heads}"
        for name, shard in actual["shards"].items():
            full = weights[name].detach()
            dim_rows = held(model.config, name, rank)
            local = full if dim_rows is None else full.index_select(dim_rows[0], dim_rows[1])
            assert torch.equal(torch.tensor(shard), local), f"{where}: {name} holds other rows than docs/design.md §8"


def test_tensor_parallel_matches_one_process(tmp_path):
    folder = save(FAST_CASE, tmp_path)
    ranks = torchrun("tp_worker.py", TP, tmp_path / "ranks", str(folder))
    check_against_one_process(folder, [result[FAST_CASE] for result in ranks])


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory) -> tuple[dict[str, Path], list[dict]]:
    """Every other case and the Llama control in one launch (each launch costs two interpreter starts)."""
    root = tmp_path_factory.mktemp("tp")
    folders = {case: save(case, root) for case in [*CASES, "llama"] if case != FAST_CASE}
    return folders, torchrun("tp_worker.py", TP, root / "ranks", *map(str, folders.values()))


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in [*CASES, "llama"] if case != FAST_CASE])
def test_tensor_parallel_matches_one_process_slow(case, slow_runs):
    folders, ranks = slow_runs
    check_against_one_process(folders[case], [result[case] for result in ranks])


def test_plan_per_version_not_serialized():
    v1, v2 = tiny_config(), tiny_config(diff_version=2)
    assert v1.base_model_tp_plan["layers.*.self_attn.q_proj"] == "diff_colwise"
    assert v2.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    assert v2.base_model_tp_plan["layers.*.self_attn.lambda_proj"] == "colwise"
    assert DiffConfig.base_model_tp_plan is v1.base_model_tp_plan, "a V2 config must not change the class's plan"
    assert "base_model_tp_plan" not in v2.to_dict()


def test_tp_size_must_divide_kv_heads():
    model = DiffForCausalLM(tiny_config(num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"needs 2 to divide num_key_value_heads \(1\)"):
        DiffForCausalLM.maybe_distribute_model(model, DistributedConfig(tp_size=2), None)
