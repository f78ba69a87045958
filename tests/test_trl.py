"""TRL's GRPO and RLOO trainers generating through transformers' continuous batching
(`use_transformers_continuous_batching=True`, which calls `model.generate_batch`) on a tiny DIFF model, on the CPU:
greedy completions equal plain `generate`'s on the same prompts, and one sampled GRPO step sends the gradient of an
independent GRPO loss (written here from the captured completions and rewards) to the weights and lambda vectors,
which the optimizer then moves. Marked slow: TRL is installed in CI's slow pass only (its requirements exclude the
floor pass's accelerate)."""

import copy
import gc
import random
from collections.abc import Callable

import pytest
import torch
from helpers import assert_close, tiny_config
from transformers import TrainerCallback

trl = pytest.importorskip("trl", reason="needs TRL (pip install trl): bash .ci/run slow installs it")
datasets = pytest.importorskip("datasets", reason="needs datasets, which TRL requires")

from diff_transformer import DiffForCausalLM  # noqa: E402
from diff_transformer.tools.data import KeyValueTask  # noqa: E402

pytestmark = pytest.mark.slow

TASK = KeyValueTask()
NEW_TOKENS = 6
GENERATIONS = 2  # completions per prompt (a GRPO / RLOO group)
LEARNING_RATE = 1e-3
ADAM_EPS = 1e-8  # Trainer's default AdamW
BATCHING = dict(page_size=16, num_blocks=16, max_batch_tokens=64)  # a small paged cache, enough for 4 requests
# The trainer's gradient and the reference's come from fp32 forwards of the same tokens, the trainer's left-padded in
# one batch: summation order only (measured: at most 2% of helpers.TOLERANCES["grad"]'s fp32 bound)


@pytest.fixture(autouse=True, scope="module")
def frozen_gc():
    """transformers' batching manager runs gc.collect() as it stops; frozen objects are skipped (faster)."""
    gc.freeze()
    yield
    gc.unfreeze()


class Capture(TrainerCallback):
    """What one trainer step did: the reward function's arguments (prompts, completion token ids) and rewards, and
    the gradients as the optimizer gets them."""

    def __init__(self, reward: Callable[[list[int]], float]):
        self.reward, self.calls, self.grads = reward, [], None
        self.__name__ = "reward"  # TRL names a reward function's logs after it

    def __call__(self, prompts: list[str], completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = [self.reward(ids) for ids in completion_ids]
        self.calls.append((list(prompts), [list(ids) for ids in completion_ids], rewards))
        return rewards

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = gradients(model)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none reached it)."""
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def tiny_model(tokenizer, initializer_range: float) -> DiffForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, initializer_range=initializer_range)
    return DiffForCausalLM._from_config(config, attn_implementation="sdpa")


def prompts(count: int) -> list[str]:
    rng = random.Random(0)
    return [TASK.example(rng)[0] for _ in range(count)]


def train_one_step(trainer_name: str, model: DiffForCausalLM, tokenizer, capture: Capture, tmp_path,
                   **config) -> None:
    """One step of `trl.<trainer_name>Trainer` with generation through continuous batching; two prompts, two
    completions each (one generation batch of 4), fp32 (`bf16=False`), no gradient clipping, no KL term (`beta=0`:
    with one, TRL loads a reference model from `config.name_or_path`, which an in-memory model has not)."""
    config_class, trainer_class = getattr(trl, f"{trainer_name}Config"), getattr(trl, f"{trainer_name}Trainer")
    args = config_class(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2 * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=NEW_TOKENS, learning_rate=LEARNING_RATE,
        max_grad_norm=0.0, beta=0.0, bf16=False, use_cpu=True, report_to=[], save_strategy="no", seed=0,
        disable_tqdm=True, use_transformers_continuous_batching=True,
        transformers_continuous_batching_config=BATCHING, **config)
    dataset = datasets.Dataset.from_dict({"prompt": prompts(2)})
    trainer = trainer_class(model=model, reward_funcs=capture, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[capture])
    trainer.train()
    assert len(capture.calls) == 1, f"{trainer_name}: {len(capture.calls)} reward calls, expected one batch"


@pytest.mark.parametrize("trainer_name", ["GRPO", "RLOO"])
def test_greedy_completions_equal_generate(trainer_name, tmp_path):
    """`do_sample=False`: every completion the trainer generated through `generate_batch` (as its reward function
    saw them) equals plain `generate`'s greedy tokens on the same prompt, before the step changed the weights."""
    tokenizer = TASK.tokenizer()
    model = tiny_model(tokenizer, initializer_range=0.2)  # peaked logits: distinct, clear greedy choices
    reference = copy.deepcopy(model).eval()
    capture = Capture(lambda ids: float(len(ids)))
    train_one_step(trainer_name, model, tokenizer, capture, tmp_path, generation_kwargs=dict(do_sample=False))
    seen_prompts, completions, _ = capture.calls[0]
    assert sorted(seen_prompts) == sorted(prompts(2) * GENERATIONS)
    for prompt, completion in zip(seen_prompts, completions):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        expected = reference.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        expected = expected[0, ids.shape[1]:].tolist()
        assert completion == expected, f"{trainer_name} {prompt!r}: {completion} != generate's {expected}"
        assert len(completion) > 1


def completion_logprobs(model: DiffForCausalLM, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion token | everything before it), one unpadded sequence."""
    ids = torch.tensor([prompt_ids + completion])
    logits = model(ids).logits[0, len(prompt_ids) - 1:-1]  # [len(completion), vocab]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def grpo_reference_grads(model: DiffForCausalLM, tokenizer, calls) -> dict[str, torch.Tensor]:
    """The gradient of one on-policy GRPO step (beta = 0, so no KL term; ratio 1, so no clipping; the `dapo`
    normalisation by the batch's completion tokens): loss = -sum_i A_i sum_t log p(y_it) / sum_i |y_i|, with
    A_i = (r_i - mean of its group) / (std of its group + 1e-4) over the completions of the same prompt."""
    prompts_seen, completions, rewards = calls[0]
    groups: dict[str, list[float]] = {}
    for prompt, reward in zip(prompts_seen, rewards):
        groups.setdefault(prompt, []).append(reward)
    model.zero_grad()
    loss = 0.0
    for prompt, completion, reward in zip(prompts_seen, completions, rewards):
        group = torch.tensor(groups[prompt])
        advantage = (reward - group.mean()) / (group.std() + 1e-4)
        loss = loss - advantage * completion_logprobs(model, tokenizer(prompt)["input_ids"], completion).sum()
    (loss / sum(len(c) for c in completions)).backward()
    return gradients(model)


def test_grpo_step_gradient_and_update(tmp_path):
    """A sampled GRPO step (temperature 1): the trainer's gradient equals the reference GRPO gradient of the
    completions it generated, is nonzero in every layer's weights and lambda vectors, and the first AdamW step
    moves each parameter by -lr * g / (|g| + eps) (Adam's first update, weight decay 0)."""
    tokenizer = TASK.tokenizer()
    model = tiny_model(tokenizer, initializer_range=0.02)  # near-uniform logits: the samples of a group differ
    before = copy.deepcopy(model)
    capture = Capture(lambda ids: float(sum(ids)))
    train_one_step("GRPO", model, tokenizer, capture, tmp_path)
    _, completions, rewards = capture.calls[0]
    assert len(set(map(tuple, completions))) == len(completions), f"sampled completions repeat: {completions}"
    assert len(set(rewards)) == len(rewards), f"rewards tie within the batch: {rewards}"

    expected = grpo_reference_grads(copy.deepcopy(before).train(), tokenizer, capture.calls)
    assert capture.grads is not None, "the optimizer never stepped"
    for name, grad in capture.grads.items():
        assert expected[name].abs().max() > 0, f"d{name}: no gradient reaches it"
        assert_close(grad, expected[name], torch.float32, f"GRPO d{name}", "grad")
    lambdas = [name for name in expected if "lambda_params" in name]
    assert len(lambdas) == 4 * 2, lambdas  # q1 k1 q2 k2 of both layers

    params, initial = dict(model.named_parameters()), dict(before.named_parameters())
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", *lambdas]:
        grad = capture.grads[name]
        step = params[name].detach() - initial[name].detach()
        assert_close(step, -LEARNING_RATE * grad / (grad.abs() + ADAM_EPS), torch.float32, f"update of {name}")
