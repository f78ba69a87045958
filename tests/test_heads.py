"""The task heads transformers gives Llama and DiffLlama, over DiffModel: token classification and question
answering (beside the causal LM and sequence classification). Output shapes, losses against cross-entropies written
out by hand (token labels -100 ignored; answer positions clamped and ignored past the end, as transformers does),
gradients through the backbone against its backward from the loss gradient written out by hand, the Auto classes
with and without the package, right padding, PEFT task types and one real Trainer step each."""

import json

import pytest
import torch
from helpers import tiny_config
from helpers.without_package import run_without_package
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoConfig,
    AutoModelForQuestionAnswering,
    AutoModelForTokenClassification,
    Trainer,
    TrainingArguments,
)

import diff_transformer
from diff_transformer import (
    DiffForCausalLM,
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
)
from diff_transformer.folder_defaults import AUTO_MODEL_CLASSES

NUM_LABELS = 5
HEADS = {"token": DiffForTokenClassification, "qa": DiffForQuestionAnswering}
AUTO = {"token": AutoModelForTokenClassification, "qa": AutoModelForQuestionAnswering}
LOSS_ATOL = 1e-6  # fp32 loss vs the fp64 hand-written cross-entropy on the same logits
PAD_ATOL = 1e-5  # fp32 logits of a right-padded row vs the row alone: the attention's summation order only
# fp32 backbone gradients vs the same backward from the hand-written loss gradient, times the peak: measured 7e-7 on
# weights; lambda's vectors get the sum of B*T*h*d terms that largely cancel, measured 1.5e-4.
GRAD_RTOL, LAMBDA_GRAD_RTOL = 1e-5, 1e-3


def build_head(kind: str, seed: int = 0, **overrides):
    """A seeded tiny head in eval mode (the token head's dropout off)."""
    torch.manual_seed(seed)
    config = tiny_config(num_labels=NUM_LABELS, **overrides)
    return HEADS[kind]._from_config(config, attn_implementation="sdpa").eval()


def head_logits(kind: str, output) -> torch.Tensor:
    """[B, T, NUM_LABELS] (token) or [B, T, 2] (start, end) logits of a head's output."""
    return output.logits if kind == "token" else torch.stack([output.start_logits, output.end_logits], -1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    """Mean over the targets != ignore of -log softmax(logits)[target], in fp64. logits [N, C], targets [N]."""
    logits = logits.double()
    kept = targets != ignore
    log_probs = logits[kept] - logits[kept].logsumexp(-1, keepdim=True)
    return -log_probs.gather(-1, targets[kept, None]).mean()


def qa_reference_loss(start: torch.Tensor, end: torch.Tensor, start_pos: torch.Tensor, end_pos: torch.Tensor):
    """Question answering loss as transformers defines it: positions clamped to [0, T], T ignored, the two
    cross-entropies averaged."""
    length = start.shape[1]
    start_pos, end_pos = start_pos.clamp(0, length), end_pos.clamp(0, length)
    return (cross_entropy(start, start_pos, length) + cross_entropy(end, end_pos, length)) / 2


def assert_near(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    diff = (actual.double() - expected.double()).abs()
    assert actual.shape == expected.shape and diff.max() <= atol, (
        f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e} (atol {atol})")


def test_the_auto_classes_build_the_heads():
    config = tiny_config(num_labels=NUM_LABELS)
    assert type(AutoModelForTokenClassification.from_config(config)) is DiffForTokenClassification
    assert type(AutoModelForQuestionAnswering.from_config(config)) is DiffForQuestionAnswering
    exported = {name for name in diff_transformer.__all__ if name.startswith("Diff")}
    assert set(AUTO_MODEL_CLASSES.values()) <= exported, sorted(set(AUTO_MODEL_CLASSES.values()) - exported)


@pytest.mark.parametrize("kind", HEADS)
def test_logits_are_the_head_over_the_last_hidden_state(kind):
    model = build_head(kind)
    batch = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        logits = head_logits(kind, model(batch))
        hidden = model.model(batch).last_hidden_state  # [B, T, hidden]
    assert type(model.model) is DiffModel
    linear = model.score if kind == "token" else model.qa_outputs
    assert logits.shape == (2, 7, NUM_LABELS if kind == "token" else 2)
    assert_near(logits, hidden @ linear.weight.T + linear.bias, 1e-6, f"{kind} logits")


def test_token_loss_ignores_minus_100():
    model = build_head("token")
    batch = torch.randint(3, 97, (2, 6))
    labels = torch.randint(0, NUM_LABELS, (2, 6))
    labels[0, :2], labels[1, -1] = -100, -100
    output = model(batch, labels=labels)
    expected = cross_entropy(output.logits.flatten(0, 1), labels.flatten(), -100)
    assert_near(output.loss, expected, LOSS_ATOL, "token classification loss")
    # a planted error: the same loss counting the ignored tokens as class 0 differs by far more than the tolerance
    assert (cross_entropy(output.logits.flatten(0, 1), labels.clamp(min=0).flatten(), -100) - expected).abs() > 1e-3


def test_qa_loss_clamps_positions_past_the_ends():
    model = build_head("qa")
    batch = torch.randint(3, 97, (3, 6))
    # row 1's start is past the end (ignored); row 2's end is negative (clamped to position 0, as transformers does)
    start_pos, end_pos = torch.tensor([1, 50, 4]), torch.tensor([3, 5, -2])
    output = model(batch, start_positions=start_pos, end_positions=end_pos)
    expected = qa_reference_loss(output.start_logits, output.end_logits, start_pos, end_pos)
    assert_near(output.loss, expected, LOSS_ATOL, "question answering loss")
    assert (qa_reference_loss(output.start_logits, output.end_logits, start_pos.clamp(max=5), end_pos)
            - expected).abs() > 1e-3, "the tokens past the end must not count"


def loss_inputs(kind: str, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Targets for a [2, T] batch: token labels with two ignored, or answer spans with one start past the end."""
    if kind == "token":
        labels = torch.arange(batch.numel()).view_as(batch) % NUM_LABELS
        labels[0, 0], labels[1, 3] = -100, -100
        return {"labels": labels}
    return {"start_positions": torch.tensor([1, 40]), "end_positions": torch.tensor([4, 3])}


def softmax_minus_onehot(logits: torch.Tensor, targets: torch.Tensor, ignore: int) -> torch.Tensor:
    """d cross_entropy(logits, targets, ignore) / d logits, written out: (softmax - one-hot) / kept count on the
    kept rows, 0 on the ignored ones. logits [N, C], targets [N]; fp64."""
    kept = targets != ignore
    grad = logits.double().softmax(-1)
    grad[kept] -= torch.nn.functional.one_hot(targets[kept], logits.shape[-1]).double()
    return grad * kept[:, None] / kept.sum()


def loss_grad_wrt_hidden(kind: str, model, logits: torch.Tensor, targets: dict) -> torch.Tensor:
    """d loss / d last hidden state [B, T, hidden], from the head's linear layer and the loss's gradient by hand."""
    if kind == "token":
        grad_logits = softmax_minus_onehot(logits.flatten(0, 1), targets["labels"].flatten(), -100)
        return (grad_logits @ model.score.weight.double()).view(*logits.shape[:2], -1)
    length = logits.shape[1]
    start, end = (targets[f"{side}_positions"].clamp(0, length) for side in ("start", "end"))
    grad_logits = torch.stack([softmax_minus_onehot(logits[..., 0], start, length),
                               softmax_minus_onehot(logits[..., 1], end, length)], -1) / 2  # [B, T, 2]
    return grad_logits @ model.qa_outputs.weight.double()


@pytest.mark.parametrize("kind", HEADS)
def test_gradients_reach_the_backbone(kind):
    """Every backbone parameter gets a gradient, equal to the backbone's backward from the hand-written gradient of
    the loss with respect to the last hidden state."""
    model = build_head(kind)
    batch = torch.randint(3, 97, (2, 6))
    targets = loss_inputs(kind, batch)
    output = model(batch, **targets)
    output.loss.backward()
    params = dict(model.model.named_parameters())
    silent = [name for name, p in params.items() if p.grad is None or not p.grad.any()]
    assert not silent, f"backbone parameters without gradient: {silent}"
    hidden = model.model(batch).last_hidden_state  # [B, T, hidden]
    grad_hidden = loss_grad_wrt_hidden(kind, model, head_logits(kind, output).detach(), targets)
    expected = torch.autograd.grad(hidden, list(params.values()), grad_outputs=grad_hidden.float())
    for (name, param), reference in zip(params.items(), expected):
        rtol = LAMBDA_GRAD_RTOL if "lambda_params" in name else GRAD_RTOL
        assert_near(param.grad, reference, rtol * reference.abs().max().item(), f"{kind} d loss / d {name}")


@pytest.mark.parametrize("kind", HEADS)
def test_right_padding(kind):
    """A right-padded row's logits over its tokens equal the row's alone; the token loss counts no label -100 and
    the answer positions index the padded row, whose padding logits stay in the softmax (as Llama's heads do)."""
    model = build_head(kind)
    rows = [torch.randint(3, 97, (7,)), torch.randint(3, 97, (4,))]
    batch = torch.zeros(2, 7, dtype=torch.long)  # pad_token_id = 0
    mask = torch.zeros(2, 7, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)], mask[i, : len(row)] = row, 1
    with torch.no_grad():
        alone = [head_logits(kind, model(row[None]))[0] for row in rows]
        if kind == "token":
            labels = torch.randint(0, NUM_LABELS, (2, 7)).masked_fill(mask == 0, -100)
            output = model(batch, attention_mask=mask, labels=labels)
            expected = cross_entropy(torch.cat(alone), labels[mask.bool()], -100)
        else:
            start_pos, end_pos = torch.tensor([2, 1]), torch.tensor([6, 3])
            output = model(batch, attention_mask=mask, start_positions=start_pos, end_positions=end_pos)
            expected = qa_reference_loss(output.start_logits, output.end_logits, start_pos, end_pos)
    logits = head_logits(kind, output)
    for i, row in enumerate(rows):
        assert_near(logits[i, : len(row)], alone[i], PAD_ATOL, f"{kind} row {i} padded vs alone")
    assert_near(output.loss, expected, PAD_ATOL, f"{kind} loss of the padded batch")


@pytest.mark.parametrize("kind", HEADS)
def test_save_reload_through_the_auto_class(kind, tmp_path):
    model = build_head(kind)
    batch = torch.randint(3, 97, (2, 6))
    model.save_pretrained(tmp_path)
    auto_map = AutoConfig.from_pretrained(tmp_path).auto_map
    assert auto_map[AUTO[kind].__name__] == f"modeling_diff.{HEADS[kind].__name__}", auto_map
    loaded = AUTO[kind].from_pretrained(tmp_path)
    assert type(loaded) is HEADS[kind]
    with torch.no_grad():
        assert torch.equal(head_logits(kind, loaded.eval()(batch)), head_logits(kind, model(batch)))


def test_a_causal_lm_folder_loads_as_every_head(tmp_path):
    """Its auto_map names every head, and each gets the language model's backbone (a new head on top)."""
    torch.manual_seed(0)
    lm = DiffForCausalLM._from_config(tiny_config())
    lm.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert {auto: ref.partition(".")[2] for auto, ref in auto_map.items() if auto != "AutoConfig"} == \
        AUTO_MODEL_CLASSES
    assert "auto_map" not in vars(lm.config), "saving left the full auto_map on the model in memory"
    for kind in HEADS:
        head = AUTO[kind].from_pretrained(tmp_path, num_labels=NUM_LABELS)
        for name, weight in lm.model.state_dict().items():
            assert torch.equal(head.model.state_dict()[name], weight), f"{kind}: backbone {name} not loaded"


def test_trust_remote_code_without_the_package(tmp_path):
    """In an interpreter without `diff_transformer`: each head's own folder, and a causal LM's folder, load through
    the Auto classes with trust_remote_code=True; the heads' logits equal the package's, and the LM's backbone
    carries over (into the sequence classifier too, whose backbone the folder's code builds the same way)."""
    batch = torch.randint(3, 97, (2, 6))
    expected = {}
    for kind in HEADS:
        model = build_head(kind)
        model.save_pretrained(tmp_path / kind)
        with torch.no_grad():
            expected[kind] = head_logits(kind, model(batch))
    torch.manual_seed(0)
    lm = DiffForCausalLM._from_config(tiny_config())
    lm.save_pretrained(tmp_path / "lm")
    torch.save({"batch": batch, "expected": expected, "embed": lm.model.embed_tokens.weight}, tmp_path / "expected.pt")
    output = run_without_package(f"""
        import torch
        from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification
        saved = torch.load({str(tmp_path / "expected.pt")!r})
        for kind, auto in (("token", AutoModelForTokenClassification), ("qa", AutoModelForQuestionAnswering)):
            model = auto.from_pretrained({str(tmp_path)!r} + "/" + kind, trust_remote_code=True).eval()
            assert not type(model).__module__.startswith("diff_transformer"), type(model).__module__
            with torch.no_grad():
                out = model(saved["batch"])
            logits = out.logits if kind == "token" else torch.stack([out.start_logits, out.end_logits], -1)
            assert torch.equal(logits, saved["expected"][kind]), (kind, (logits - saved["expected"][kind]).abs().max())
            head = auto.from_pretrained({str(tmp_path / "lm")!r}, trust_remote_code=True, num_labels={NUM_LABELS})
            assert type(head).__name__.endswith(type(model).__name__[4:]), type(head)
            assert torch.equal(head.model.embed_tokens.weight, saved["embed"]), kind
            print(kind, "ok", type(model).__name__, type(head).__name__)
        from transformers import AutoModelForSequenceClassification
        head = AutoModelForSequenceClassification.from_pretrained({str(tmp_path / "lm")!r}, trust_remote_code=True)
        assert torch.equal(head.model.embed_tokens.weight, saved["embed"])
        print("seq ok", type(head).__name__)
    """, tmp_path)
    assert "token ok DiffForTokenClassification DiffForTokenClassification" in output, output
    assert "qa ok DiffForQuestionAnswering DiffForQuestionAnswering" in output, output
    assert "seq ok DiffForSequenceClassification" in output, output


@pytest.mark.parametrize("head_class, task_type, head", [
    (DiffForTokenClassification, "TOKEN_CLS", "score"), (DiffForQuestionAnswering, "QUESTION_ANS", "qa_outputs"),
    (DiffForSequenceClassification, "SEQ_CLS", "score"),
])
def test_peft_task_types(head_class, task_type, head):
    """LoraConfig with only the task type: LoRA on the default projections, the head trained in full."""
    torch.manual_seed(0)
    model = get_peft_model(head_class(tiny_config(num_labels=NUM_LABELS)), LoraConfig(task_type=task_type, r=4))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any(".q_proj.lora_A." in name for name in trainable), sorted(trainable)
    assert any(f"{head}.modules_to_save." in name for name in trainable), sorted(trainable)
    assert not any("embed_tokens" in name for name in trainable), sorted(trainable)


def task_examples(kind: str) -> list[dict]:
    """Four rows of 6 tokens: a token label per token (one ignored), or an answer span."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (4, 6), generator=generator)
    if kind == "token":
        labels = torch.randint(0, NUM_LABELS, (4, 6), generator=generator)
        labels[:, 0] = -100
        return [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]
    spans = torch.tensor([[1, 3], [0, 0], [2, 5], [4, 4]])
    return [{"input_ids": i, "start_positions": s[0], "end_positions": s[1]} for i, s in zip(ids, spans)]


@pytest.mark.parametrize("kind", HEADS)
def test_one_trainer_step(kind, tmp_path):
    """The logged loss is the loss of the whole batch before the step; AdamW's first step moves every weight of
    the head and of the backbone against its gradient's sign."""
    model = build_head(kind, classifier_dropout=0.0)
    examples = task_examples(kind)
    batch = {key: torch.stack([row[key] for row in examples]) for key in examples[0]}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=examples)
    trainer.train()
    logged = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 1 and abs(logged[0] - loss.item()) < 1e-3, f"logged {logged}, batch loss {loss.item()}"
    for name in ("model.layers.0.self_attn.lambda_params.q1", "model.layers.1.mlp.down_proj.weight",
                 "score.weight" if kind == "token" else "qa_outputs.weight"):
        delta, grad = dict(model.named_parameters())[name].detach() - before[name], grads[name]
        moved = grad.abs() > 1e-6
        assert moved.any() and torch.equal(delta[moved].sign(), -grad[moved].sign()), (
            f"{kind} {name}: {(delta[moved].sign() != -grad[moved].sign()).sum()} of {moved.sum()} moved the wrong way")
