"""A caller's own generation length is in force whatever a saved folder's generation_config.json holds: its default
`max_new_tokens` (half the context, so that `generate()` without a length is not cut at transformers' 20 tokens)
must not override the `max_length` a caller passes, as lm-eval's `generate_until` does (prompt + the task's
`max_gen_toks`); checked through lm-eval itself on a custom task read from local files."""

import json
import random

import pytest
import torch
from helpers.folders import save_tiny_folder
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from diff_transformer.tools.data import KeyValueTask

NEW_TOKENS = 3  # the task's max_gen_toks: far below the folder's default of half its 256-token context


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny DIFF folder as save_pretrained writes it (generation_config.json: max_new_tokens 128), no eos token:
    generation runs to the length it is given."""
    folder = save_tiny_folder(tmp_path_factory.mktemp("lengths") / "model")
    assert json.loads((folder / "generation_config.json").read_text())["max_new_tokens"] == 128
    return folder


def new_tokens(model, ids: torch.Tensor, **lengths) -> int:
    return model.generate(ids, do_sample=False, **lengths).shape[1] - ids.shape[1]


def test_callers_length_in_force(folder):
    """max_length (as a keyword or in a generation config), max_new_tokens, or none: the caller's wins, the folder's
    default applies only when the caller gives none (before: max_length=prompt+3 generated 128 tokens)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[1, 5, 9, 12]])
    assert new_tokens(model, ids, max_length=ids.shape[1] + NEW_TOKENS) == NEW_TOKENS
    by_config = GenerationConfig(max_length=ids.shape[1] + 2, do_sample=False)
    assert new_tokens(model, ids, generation_config=by_config) == 2
    assert new_tokens(model, ids, max_new_tokens=5) == 5
    assert new_tokens(model, ids, max_new_tokens=4, max_length=ids.shape[1] + 9) == 4  # transformers' precedence
    assert new_tokens(model, ids) == model.config.max_position_embeddings // 2
    assert model.generation_config.max_new_tokens == 128, "the model's own default is kept after a call"


TASK = """
task: diff_kv_lengths
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {new_tokens}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def greedy_answers(folder, prompts: list[str]) -> list[str]:
    """Plain greedy `generate` with the task's own length and stop, on the prompt as lm-eval encodes it with
    add_bos_token=True (<s> first): the reference each doc's target is set to."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    answers = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=True)])
        output = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0])
    return answers


@pytest.mark.slow
def test_lm_eval_generate_until_matches_plain_greedy(folder, tmp_path, monkeypatch):
    """lm-eval's generate_until on a DIFF folder scores exact match 1.0 against plain greedy `generate` with the
    task's max_gen_toks (before: 0.0, every doc generating the folder's 128 tokens)."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval)")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = random.Random(0)
    prompts = [KeyValueTask().example(rng)[0] for _ in range(6)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                            for p, a in zip(prompts, greedy_answers(folder, prompts))))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "diff_kv_lengths.yaml").write_text(TASK.format(data=data, new_tokens=NEW_TOKENS))
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32,add_bos_token=True", tasks=["diff_kv_lengths"],
        batch_size=1, device="cpu", log_samples=True, task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
    )
    samples = results["samples"]["diff_kv_lengths"]
    responses = {sample["doc"]["prompt"]: sample["filtered_resps"][0] for sample in samples}
    targets = {sample["doc"]["prompt"]: sample["doc"]["answer"] for sample in samples}
    assert responses == targets, {p: (responses[p], targets[p]) for p in prompts if responses[p] != targets[p]}
    assert results["results"]["diff_kv_lengths"]["exact_match,none"] == 1.0, results["results"]
