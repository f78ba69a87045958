"""pipeline("text-generation") on a saved folder path (issue #4): greedy, sampling, beam search, max_new_tokens,
stop tokens and batching."""

from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from transformers import pipeline, set_seed

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.data import KeyValueTask
from diff_transformer.tools.tokenizer import train_bpe_tokenizer

PROMPTS = ["k1 v2 k3 v4 ? k1", "k5 v6 ?", "k7 v8 k9 v10 k11 v12 ? k9"]
NEW_TOKENS = 6


def save_tiny_folder(path: Path) -> Path:
    """A tiny DiffForCausalLM and a byte-level BPE tokenizer, saved together (also used by the Hub tests)."""
    tokenizer = train_bpe_tokenizer(texts=KeyValueTask().texts(200), vocab_size=300)
    config = tiny_config(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=None, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = DiffForCausalLM._from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path



@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    folder = save_tiny_folder(tmp_path_factory.mktemp("model"))
    return pipeline("text-generation", model=str(folder))


def new_ids(generator, prompt: str, output: dict) -> list[int]:
    prompt_ids = generator.tokenizer(prompt)["input_ids"]
    ids = output["generated_token_ids"]
    while ids[0] == generator.tokenizer.pad_token_id:  # batched prompts are left-padded
        ids = ids[1:]
    assert ids[: len(prompt_ids)] == prompt_ids, "the output must start with the prompt"
    return ids[len(prompt_ids) :]


def generate(generator, prompts, **kwargs) -> list[list[dict]]:
    return generator(prompts, return_tensors=True, max_new_tokens=NEW_TOKENS, **kwargs)


def test_loads_from_folder_with_auto_classes(generator):
    assert type(generator.model) is DiffForCausalLM
    assert generator.tokenizer.padding_side == "left"


def test_greedy_max_new_tokens_and_text(generator):
    output = generator(PROMPTS[0], max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
    ids = new_ids(generator, PROMPTS[0], generate(generator, PROMPTS[0], do_sample=False)[0])
    assert len(ids) == NEW_TOKENS
    prompt_ids = generator.tokenizer(PROMPTS[0])["input_ids"]

    def decode(token_ids: list[int]) -> str:
        return generator.tokenizer.decode(token_ids, skip_special_tokens=True)

    # pipeline decodes prompt and new tokens together, without special tokens, and keeps what follows the prompt
    assert output == PROMPTS[0] + decode(prompt_ids + ids)[len(decode(prompt_ids)):], output


def test_batched_equals_one_by_one(generator):
    one_by_one = [new_ids(generator, p, generate(generator, p, do_sample=False)[0]) for p in PROMPTS]
    batched = generate(generator, PROMPTS, do_sample=False, batch_size=len(PROMPTS))
    assert [new_ids(generator, p, out[0]) for p, out in zip(PROMPTS, batched)] == one_by_one


def test_sampling_is_seeded(generator):
    def sample(seed: int) -> list[int]:
        set_seed(seed)
        return new_ids(generator, PROMPTS[1], generate(generator, PROMPTS[1], do_sample=True, temperature=1.5)[0])

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_beam_search(generator):
    outputs = generate(generator, PROMPTS[0], num_beams=3, num_return_sequences=3, do_sample=False)
    beams = [new_ids(generator, PROMPTS[0], out) for out in outputs]
    assert len({tuple(b) for b in beams}) == 3, beams
    prompt = generator.tokenizer(PROMPTS[0], return_tensors="pt")
    direct = generator.model.generate(**prompt, num_beams=3, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert beams[0] == direct[0, prompt["input_ids"].shape[1] :].tolist()


def test_stop_token_ends_generation(generator):
    greedy = new_ids(generator, PROMPTS[2], generate(generator, PROMPTS[2], do_sample=False)[0])
    words = [generator.tokenizer.decode([token]) for token in greedy]
    # a token past the first that decodes to whole printable characters on its own, so it also works as a stop string
    stop = next(t for t, w in zip(greedy[1:], words[1:]) if w.isprintable() and "\ufffd" not in w)
    stopped = new_ids(generator, PROMPTS[2], generate(generator, PROMPTS[2], do_sample=False, eos_token_id=stop)[0])
    assert stopped == greedy[: greedy.index(stop) + 1], (stopped, greedy)
    word = generator.tokenizer.decode([stop])
    text = generator(PROMPTS[2], max_new_tokens=NEW_TOKENS, do_sample=False, stop_sequence=word)[0]["generated_text"]
    expected = PROMPTS[2] + generator.tokenizer.decode(greedy[: greedy.index(stop) + 1])
    assert text == expected, (text, expected)
