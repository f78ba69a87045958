"""Saved folders: what they hold and ship, how from_pretrained answers for a wrong one, and clients that load them.

The code a saved folder ships (what a Hub user downloads with trust_remote_code) stands alone: it names no file the
folder lacks, and no project path or history. Loading a folder that is missing, of another architecture, or with an
unknown attention backend answers in one line naming the fix; `pipeline` without `import diff_transformer` is
explained on the troubleshooting page.

Saved folders as their clients use them, in a fresh interpreter where `diff_transformer` cannot be imported:
`AutoTokenizer` loads transformers' own tokenizer class without a word of output, LoRA finds its default targets from
the folder's model code, and `pipeline` with no generation arguments stops within the context. The folder records
`use_cache: true` and generation defaults, and BOS is placed the same way in training, in the tokenizer and in an
lm-eval-style evaluation."""


import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import build_stack, saved_folders
from helpers.training import make_trainer
from helpers.without_package import client_results
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, pipeline
from transformers.utils import logging as transformers_logging

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.peft_defaults import LORA_TARGET_MODULES
from diff_transformer.tools.commands import load_checked_model
from diff_transformer.tools.data import KeyValueTask, encode_example, text_file_dataset
from diff_transformer.tokenization_diff import train_bpe_tokenizer
from diff_transformer_cli import main

ROOT = Path(__file__).resolve().parents[1]
PROMPT, ANSWER = "k3 v7 k9 v2 ? k9", "v2"
LOGPROB_ATOL = 1e-5  # the same tokens through forwards of different lengths: fp32 summation order only

def read_json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "chat"])
def cli_folder(request, tmp_path_factory) -> tuple[Path, bool]:
    chat = request.param
    folder = tmp_path_factory.mktemp("cli") / "model"
    main(["train", "--max-steps", "20", "--examples", "300", "--output", str(folder), "--max-new-tokens", "1",
          *(["--chat-template"] if chat else [])])
    return folder, chat


def test_cli_folder_files(cli_folder):
    folder, chat = cli_folder
    assert read_json(folder, "config.json")["use_cache"] is True, "Trainer's use_cache=False was saved"
    generation = read_json(folder, "generation_config.json")
    context = read_json(folder, "config.json")["max_position_embeddings"]
    expected = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": context // 2}
    assert {key: generation.get(key) for key in expected} == expected and "max_length" not in generation, generation
    tokenizer_config = read_json(folder, "tokenizer_config.json")
    assert tokenizer_config["tokenizer_class"] == "TokenizersBackend" and "auto_map" not in tokenizer_config
    assert tokenizer_config["model_max_length"] == read_json(folder, "config.json")["max_position_embeddings"]
    assert ((folder / "chat_template.jinja").is_file()) == chat


def test_cli_folder_in_client_without_package(cli_folder, tmp_path):
    folder, chat = cli_folder
    result = client_results(folder, PROMPT, chat, tmp_path)
    assert result["tokenizer"].startswith("transformers."), f"tokenizer from custom code: {result['tokenizer']}"
    assert result["model"].startswith("transformers_modules."), result["model"]
    assert result["lora"] == sorted(LORA_TARGET_MODULES), result["lora"]
    assert result["plain_tokenizer_agrees"], "PreTrainedTokenizerFast.from_pretrained encodes differently"

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert result["prompt_ids"] == encode_example(tokenizer, PROMPT), "the client's prompt is not the training format"
    model = DiffForCausalLM.from_pretrained(folder).eval()
    max_length = len(result["prompt_ids"]) + model.generation_config.max_new_tokens  # the prompt is short
    assert max_length <= model.config.max_position_embeddings, (max_length, model.config.max_position_embeddings)
    for generated in (result["generated"], result["greedy"]):
        assert generated[: len(result["prompt_ids"])] == result["prompt_ids"], generated
        assert len(generated) <= max_length, f"{len(generated)} tokens, past max_length={max_length}"
        assert generated[-1] == tokenizer.eos_token_id or len(generated) == max_length, generated
    expected = model.generate(torch.tensor([result["prompt_ids"]]), do_sample=False)[0].tolist()
    assert result["greedy"] == expected, (result["greedy"], expected)
    if chat:
        assert result["chat_reply"]["role"] == "assistant", result["chat_reply"]


@contextmanager
def transformers_warnings() -> Iterator[list[str]]:
    """The messages transformers logs at warning level or above inside the block (the tests run it at error)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    root = logging.getLogger("transformers")
    previous = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        transformers_logging.set_verbosity(previous)


def old_folder(folder: Path, copy: Path) -> Path:
    """A copy of `folder` with the generation config older versions saved: `max_length` = the context."""
    shutil.copytree(folder, copy)
    generation = read_json(copy, "generation_config.json")
    generation.pop("max_new_tokens")
    generation["max_length"] = read_json(copy, "config.json")["max_position_embeddings"]
    (copy / "generation_config.json").write_text(json.dumps(generation))
    return copy


def test_max_new_tokens_without_a_length_warning(cli_folder, tmp_path):
    """A saved folder serves generate() without arguments past transformers' 20 tokens and a call passing
    max_new_tokens without "Both `max_new_tokens` and `max_length` seem to have been set" (logged on every such
    call while folders saved max_length: 24 times in one eval-needle run). A folder saved that way still loads; the
    commands and save_pretrained read it as the new form, plain from_pretrained keeps it (and the warning)."""
    folder, chat = cli_folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(PROMPT, return_tensors="pt")
    old = old_folder(folder, tmp_path / "old")
    config = DiffConfig.from_pretrained(folder)
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    LlamaForCausalLM(LlamaConfig(**{name: getattr(config, name) for name in sizes})).save_pretrained(tmp_path / "llama")
    models = {"llama": LlamaForCausalLM.from_pretrained(tmp_path / "llama"),
              "new": DiffForCausalLM.from_pretrained(folder), "old": DiffForCausalLM.from_pretrained(old),
              "old via the commands": load_checked_model(str(old))}
    length_warnings = {}
    for name, model in models.items():
        with transformers_warnings() as logged:
            pipeline("text-generation", model=model.eval(), tokenizer=tokenizer)(PROMPT, max_new_tokens=2)
            model.generate(**ids, max_new_tokens=2, do_sample=False)
        length_warnings[name] = {message for message in logged if "max_new_tokens" in message}
    # the reference: what transformers logs for a Llama folder it saved itself (nothing from 5.18 on; 5.17's pipeline
    # passes a generation config together with max_new_tokens and warns for any model)
    reference = length_warnings.pop("llama")
    extra = {name: messages - reference for name, messages in length_warnings.items()}
    assert extra == {"new": set(), "old": extra["old"], "old via the commands": set()} and extra["old"], extra
    model = models["new"]
    model.generation_config.eos_token_id = None  # no early stop: the default length shows
    output = model.generate(**ids, do_sample=False)
    assert output.shape[1] - ids["input_ids"].shape[1] == model.config.max_position_embeddings // 2 > 20, output.shape
    models["old"].save_pretrained(tmp_path / "resaved")
    generation = read_json(tmp_path / "resaved", "generation_config.json")
    assert generation["max_new_tokens"] == 128 and "max_length" not in generation, generation


def test_cli_text_blocks_start_like_the_tokenizer(tmp_path):
    text = "\n".join(KeyValueTask().texts(50))
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    tokenizer = train_bpe_tokenizer(texts=[text], vocab_size=300)
    blocks = [block["input_ids"].tolist() for block in text_file_dataset(tmp_path / "corpus.txt", tokenizer, 16)]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and blocks[0] == ids[:16], (blocks[0], ids[:16])
    assert all(block[0] == tokenizer.bos_token_id and len(block) == 16 for block in blocks)
    assert [t for block in blocks for t in block[1:]] == ids[1 : 1 + 15 * len(blocks)]


def test_trainer_checkpoint_saves_cache_on_and_generation_defaults(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    model = trainer.model
    assert model.config.use_cache is False, "precondition: Trainer turns the cache off for training"
    trainer.save_model(tmp_path / "model")
    assert read_json(tmp_path / "model", "config.json")["use_cache"] is True
    generation = read_json(tmp_path / "model", "generation_config.json")
    assert generation["max_new_tokens"] == model.config.max_position_embeddings // 2 == 128, generation
    assert "max_length" not in generation, generation
    assert generation["pad_token_id"] == model.config.pad_token_id, generation
    assert model.config.use_cache is False and model.generation_config.max_new_tokens is None, "saving changed it"


def token_logprobs(model: DiffForCausalLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def lm_eval_loglikelihood(model, tokenizer, context: str, continuation: str, add_bos: bool) -> tuple[list[int], float]:
    """lm-eval's `loglikelihood` for a causal model: encode context + continuation, split off the context's tokens,
    score the rest. add_bos=True is lm-eval's default (the tokenizer's own special tokens), False `add_bos_token=False`.
    Returns the model's input (all tokens but the last) and the continuation's log-likelihood."""
    options = {} if add_bos else {"add_special_tokens": False}
    whole = tokenizer(context + continuation, **options)["input_ids"]
    n_context = len(tokenizer(context, **options)["input_ids"])
    return whole[:-1], token_logprobs(model, whole)[n_context - 1 :].sum().item()


def lm_eval_rolling_loglikelihood(model, tokenizer, text: str) -> tuple[list[int], float]:
    """lm-eval's `loglikelihood_rolling` with `add_bos_token=False` and a text shorter than the context: one window,
    `[prefix_token] + tokens[:-1]` predicting `tokens`, where prefix_token is the tokenizer's BOS."""
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    inputs = [tokenizer.bos_token_id, *tokens]
    return inputs[:-1], token_logprobs(model, inputs).sum().item()


@pytest.mark.parametrize("cli_folder", [False], ids=["plain"], indirect=True)  # lm-eval scores plain text
def test_lm_eval_style_loglikelihood_sees_the_training_tokens(cli_folder):
    folder, chat = cli_folder
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = DiffForCausalLM.from_pretrained(folder).eval()
    training = encode_example(tokenizer, PROMPT, ANSWER)  # what the CLI trained on: <s> prompt answer
    assert training[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in training, training
    training_logprobs = token_logprobs(model, training)

    inputs, loglikelihood = lm_eval_loglikelihood(model, tokenizer, PROMPT, " " + ANSWER, add_bos=True)
    assert inputs == training[:-1], "with BOS from the tokenizer, lm-eval must feed the training tokens"
    expected = training_logprobs[-1].item()  # the answer's log-probability inside the training sequence
    assert abs(loglikelihood - expected) <= LOGPROB_ATOL, (loglikelihood, expected)

    inputs, _ = lm_eval_loglikelihood(model, tokenizer, PROMPT, " " + ANSWER, add_bos=False)
    assert inputs == training[1:-1], "without BOS the input is the training sequence minus its <s>"

    inputs, rolling = lm_eval_rolling_loglikelihood(model, tokenizer, f"{PROMPT} {ANSWER}")
    assert inputs == training[:-1], "the rolling window's BOS prefix must be the training sequence's <s>"
    expected = training_logprobs.sum().item()  # every training target
    assert abs(rolling - expected) <= LOGPROB_ATOL, (rolling, expected)


FILE_NAME = re.compile(r"(?<![\w.])((?:[\w-]+/)*[\w-]+\.(?:py|md|json|txt|yaml|yml|ipynb|safetensors|bin|pt))\b")
PROJECT_PATH = re.compile(r"\b(?:docs|benchmarks|tests|examples|configs|notebooks|tools)/")
HISTORY = re.compile(r"\b(?:transformers|torch|triton) *[<>=]* *\d+\.\d+|issue #\d+", re.IGNORECASE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hub") / "model"
    build_stack("sdpa", "V1-GQA").save_pretrained(path)
    return path


def shipped_code(folder: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(folder.glob("*.py"))}


# The package's flat modules that a saved folder does not hold: the package's entry and version, and the two public
# modules that are no part of a model (the authors' module API; the tokenizer builders, whose tokenizers are
# transformers' built-in ones). Every other module of diff_transformer/ is the folder's code, byte for byte.
NOT_SHIPPED = {"__init__.py", "_version.py", "multihead_diffattn.py", "tokenization_diff.py"}


def test_the_folder_ships_the_model_code(folder):
    """The package's top level, less NOT_SHIPPED, is exactly the code a saved folder holds (and what `upload`
    publishes): the listing of diff_transformer/ is the shipped set."""
    from diff_transformer.tools.hub_upload import code_files

    package = ROOT / "diff_transformer"
    listing = {path.name for path in package.glob("*.py")} - NOT_SHIPPED
    shipped = shipped_code(folder)
    assert set(shipped) == listing == {path.name for path in code_files()}, (
        f"saved only: {sorted(set(shipped) - listing)}, listed only: {sorted(listing - set(shipped))}")
    changed = [name for name, text in shipped.items() if text != (package / name).read_text()]
    assert not changed, f"saved files differ from the package's: {changed}"


@pytest.mark.parametrize("name", ["modeling_diff.py", "configuration_diff.py", "kernel_tiled.py",
                                  "kernel_diff_flash.py", "diff_tensor_parallel.py", "peft_defaults.py",
                                  "folder_defaults.py", "paged_cache.py", "kernel_tiles.py", "diff_lambda.py",
                                  "poly_norm.py", "input_checks.py", "decoder_layers.py", "registration.py",
                                  "kernel_naive.py", "config_checks.py"])
def test_shipped_file_names_only_what_the_folder_holds(folder, name):
    text = shipped_code(folder)[name]
    present = {path.name for path in folder.iterdir()}
    missing = sorted({ref for ref in FILE_NAME.findall(text) if ref.rpartition("/")[2] not in present})
    assert not missing, f"{name} names files a saved folder lacks: {missing}"
    paths = [text[max(0, m.start() - 40): m.end() + 20] for m in PROJECT_PATH.finditer(text)]
    assert not paths, f"{name} points into the project's tree: {paths}"
    history = [text[max(0, m.start() - 40): m.end() + 20] for m in HISTORY.finditer(text)]
    assert not history, f"{name} carries versions or history: {history}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    """diff (a DIFF model and its English BPE tokenizer) and llama (helpers.saved_folders)."""
    return saved_folders(tmp_path_factory.mktemp("mistakes"), ("diff", "llama"))


@pytest.mark.parametrize("path", ["./typo", "typo", "runs/typo", "/no/such/folder"])
def test_missing_local_folder_is_not_asked_of_the_hub(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # so "runs/typo" is plainly local
    for load in (DiffForCausalLM.from_pretrained, DiffConfig.from_pretrained):
        with pytest.raises(FileNotFoundError, match=f"no such folder: {path} "):
            load(path)


def test_other_architecture_points_to_convert(folders):
    with pytest.raises(ValueError, match=r"holds a 'llama' model, not a DIFF Transformer .*diff-transformer convert"):
        DiffForCausalLM.from_pretrained(folders / "llama")


def test_unknown_attention_names_diff_flash(folders):
    """transformers' list of its backends, and ours, which it lacks."""
    with pytest.raises(ValueError, match=r'"flashh"` is not supported\. The only possible arguments are .*sdpa.*\. The '
                                         r'DIFF Transformer adds `attn_implementation="diff_flash"`'):
        DiffForCausalLM.from_pretrained(folders / "diff", attn_implementation="flashh")


PIPELINE_WITHOUT_IMPORT = """
import sys
from transformers import pipeline
try:
    pipeline("text-generation", model=sys.argv[1])
except ValueError as error:
    print("ANSWER", " ".join(str(error).split()))
"""


def test_pipeline_without_the_package_is_explained(folders):
    """`pipeline(model=FOLDER)` without `import diff_transformer`: transformers refuses the folder's remote code (after
    asking on a terminal); its message offers trust_remote_code=True only, so the troubleshooting page names the other
    way, `import diff_transformer`, for that message."""
    result = subprocess.run([sys.executable, "-c", PIPELINE_WITHOUT_IMPORT, str(folders / "diff")],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}, cwd=folders)
    answer = result.stdout.split("ANSWER ", 1)[-1]
    assert "contains custom code which must be executed" in answer and "trust_remote_code=True" in answer, result
    rows = [row for row in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines()
            if "contains custom code which must be executed" in row]
    assert len(rows) == 1 and "import diff_transformer" in rows[0] and "trust_remote_code=True" in rows[0], rows



def save_stack(folder: Path, stack: str) -> DiffForCausalLM:
    """A saved tiny model of one of STACKS (hidden 128: bitsandbytes' CPU kernels take widths in multiples of 64)."""
    model = build_stack("sdpa", stack, hidden_size=128, intermediate_size=256, vocab_size=128).eval()
    model.save_pretrained(folder)
    return model


def test_fp16_load_keeps_the_v2_lambda_gate_in_fp32(tmp_path):
    """`_keep_in_fp32_modules`: V2's lambda_proj loads in fp32 beside fp16 weights and reads fp16 hidden states."""
    reference = save_stack(tmp_path, "V2")
    model = DiffForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).eval()
    attention = model.model.layers[0].self_attn
    assert attention.lambda_proj.weight.dtype == torch.float32 and attention.q_proj.weight.dtype == torch.float16
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).logits.float() - reference(ids).logits).abs()
    assert diff.max() < 2e-2, f"fp16 logits against fp32: max {diff.max():.3g}, mean {diff.mean():.3g}"  # measured 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("stack", ["V1-GQA", "V2", "hybrid"])
def test_bitsandbytes_quantizes_projections_not_the_lambda_gate(stack, bits, tmp_path):
    """bitsandbytes 4-bit and 8-bit on every stack: the projections are quantized, V2's lambda_proj (h outputs) is
    not; the model runs and generates, its logits close to the unquantized model's (measured cosine >= 0.988 at
    4 bits, >= 0.9995 at 8 bits)."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (bash .ci/run slow installs it)")
    from transformers import BitsAndBytesConfig

    reference = save_stack(tmp_path, stack)
    config = BitsAndBytesConfig(load_in_4bit=True) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)
    model = DiffForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu").eval()
    quantized = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}
    assert quantized == {"Linear4bit" if bits == 4 else "Linear8bitLt"}, quantized
    gates = [type(m) for n, m in model.named_modules() if n.endswith("lambda_proj")]
    assert gates == ([torch.nn.Linear] * 2 if stack == "V2" else []), gates
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids).logits.float(), reference(ids).logits
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
    assert cosine > {4: 0.95, 8: 0.995}[bits], \
        f"{bits}-bit logits: cosine {cosine:.4f}, max diff {(ours - theirs).abs().max():.3g}"
    assert model.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, 13)


def test_weights_manifest_records_what_was_saved(tmp_path):
    """save_pretrained records each weight file's sha256 (hashlib over the file, here the reference); the check passes
    on the folder as saved and on one without a manifest (saved by other code), and names the file where one byte of
    its data changed or it is missing, in one line."""
    import hashlib

    from diff_transformer.saved_folder import WEIGHTS_MANIFEST, FolderError, check_weights_manifest

    folder = tmp_path / "model"
    build_stack("sdpa", "V1-GQA").save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(path.name for path in folder.glob("*.safetensors"))
    assert len(shards) > 1, shards
    recorded = read_json(folder, WEIGHTS_MANIFEST)["sha256"]
    assert recorded == {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in shards}
    check_weights_manifest(folder)
    data = bytearray((folder / shards[-1]).read_bytes())
    data[-1] ^= 1  # the last byte: tensor data, not the header
    (folder / shards[-1]).write_bytes(bytes(data))
    (folder / shards[0]).unlink()
    with pytest.raises(FolderError) as error:
        check_weights_manifest(folder)
    message = str(error.value)
    assert "\n" not in message and f"{shards[0]} is missing; {shards[-1]} is not the file save_pretrained wrote" in \
        message, message
    (folder / WEIGHTS_MANIFEST).unlink()
    check_weights_manifest(folder)


def test_size_from_the_config_alone(tmp_path):
    """The parameters a config implies, counted without building a model, equal the model's for each attention stack
    and untied embeddings; a folder whose weights would not fit the memory available is refused in one line before
    anything is built."""
    from helpers import STACKS

    from diff_transformer.tools.model_size import check_model_size, config_parameters

    for stack in STACKS:
        model = build_stack("sdpa", stack)
        assert config_parameters(model.config) == model.num_parameters(), stack
    model = build_stack("sdpa", "V1-GQA", tie_word_embeddings=False, attention_bias=False)
    assert config_parameters(model.config) == model.num_parameters()
    model.save_pretrained(tmp_path)
    check_model_size(str(tmp_path), model.config)
    needed = 4 * model.num_parameters()
    with pytest.raises(ValueError) as error:
        check_model_size(str(tmp_path), model.config, available=needed - 1)
    assert str(error.value).startswith(f"{tmp_path} needs about 0.0 GiB of memory for its {model.num_parameters():,} "
                                       "weights (num_hidden_layers=2, "), error.value
    check_model_size(str(tmp_path), model.config, available=needed)


def test_pickled_weights_refused_with_the_safe_fix(tmp_path):
    """A DIFF folder whose weights are a pickle that runs code: from_pretrained refuses it (torch's weights_only)
    with the fix that runs none of it (torch's message suggests weights_only=False), and the code never runs."""
    from helpers.folders import planted_pickle

    folder = tmp_path / "model"
    build_stack("sdpa", "V1-GQA").save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(planted_pickle(tmp_path / "pwned"))
    refusal = r"^refused to load the pickled weights in .*: they hold more than tensors"
    with pytest.raises(OSError, match=refusal) as error:
        DiffForCausalLM.from_pretrained(folder)
    assert "weights_only=False:" in str(error.value) and not (tmp_path / "pwned").exists()
