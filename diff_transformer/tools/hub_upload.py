"""Publish a saved DIFF Transformer folder (model + tokenizer) to the Hugging Face Hub.

    diff-transformer upload MODEL_DIR REPO_ID [--dry-run] [--private] [--license mit]

Writes a model card (README.md), makes sure `auto_map` and the model code are in the folder so that it loads with
`trust_remote_code=True` and no `diff_transformer` install, sets the defaults clients expect (`use_cache: true`, a
generation_config.json that stops within the context), checks the client calls in a clean subprocess on a staged
copy (the folder is changed only once the check passes), then uploads.
The token comes from HF_TOKEN or `hf auth login`; it is never printed or written anywhere.

No code from the folder ever runs: an `auto_map` (in any of its JSON files) naming anything but the package's own
classes is refused before any work, the check runs on a copy holding only the files that are published (the
package's code, written there from the package, the config, generation config, card, safetensors weights and
tokenizer), in an environment without the user's secrets, and only those files are uploaded.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData, get_token
from transformers import GenerationConfig
from transformers.dynamic_module_utils import get_relative_import_files

from .. import (
    __version__,
    DiffConfig,
    DiffForCausalLM,
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
)
from ..folder_defaults import generation_defaults
from ..saved_folder import TOKENIZER_FILES, WEIGHTS_MANIFEST, FolderError, check_folder, pickled_files, read_json

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
AUTO_CLASSES = (
    DiffConfig,
    DiffModel,
    DiffForCausalLM,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffForQuestionAnswering,
)
CONFIG_ROWS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "diff_version", "lambda_init", "use_subln", "max_position_embeddings",
    "rope_parameters", "tie_word_embeddings", "dtype",
)
# What a published folder holds besides the package's code (`code_files`) and its *.safetensors weights.
PUBLISHED = ("config.json", "generation_config.json", "README.md", "model.safetensors.index.json", *TOKENIZER_FILES,
             "merges.txt", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
             "chat_template.jinja", "chat_template.json", WEIGHTS_MANIFEST)
# Environment variables the loadability check's interpreter does not inherit: anything that may hold a credential.
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


class UploadError(ValueError):
    """A problem with the user's input, reported by the CLI in one line."""


def check_inputs(model_dir: Path, repo_id: str) -> dict:
    if not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise UploadError(f"repo id {repo_id!r} must look like 'user-or-org/model-name'")
    try:
        return check_folder(model_dir, diff=True)
    except FolderError as error:
        raise UploadError(str(error)) from None


def foreign_code(model_dir: Path, config: dict) -> list[str]:
    """What in `model_dir` would make a client run code that is not the package's: each `auto_map` entry (of
    config.json, tokenizer_config.json or any other JSON file of the folder) other than the package's own
    (`auto_map`), and config.json's `custom_pipelines`; as "file: entry" strings."""
    own = auto_map()
    found = [f"config.json: auto_map {key}={value!r}" for key, value in config.get("auto_map", {}).items()
             if own.get(key) != value]
    found += [f"config.json: custom_pipelines {name!r}" for name in config.get("custom_pipelines", {})]
    for path in sorted(model_dir.glob("*.json")):
        if path.name != "config.json":
            entries = json_auto_map(path)
            found += [f"{path.name}: auto_map {key}={value!r}" for key, value in entries.items()]
    return found


def json_auto_map(path: Path) -> dict:
    """The `auto_map` of a JSON file of settings; none for a file that is not a JSON object."""
    try:
        value = read_json(path)
    except ValueError:
        return {}
    entries = value.get("auto_map") or {}
    return entries if isinstance(entries, dict) else {"": entries}


def check_no_foreign_code(model_dir: Path, config: dict) -> None:
    """`UploadError` in one line where the folder names code that is not the package's (`foreign_code`): the check
    would run it, and the Hub's users with trust_remote_code=True."""
    found = foreign_code(model_dir, config)
    if found:
        raise UploadError(f"{model_dir} names code that is not the diff_transformer package's ({'; '.join(found)}); "
                          "upload publishes only the package's model code and runs none from the folder: remove "
                          "those entries (a DIFF model and its tokenizer need none)")


def published_files(model_dir: Path) -> list[str]:
    """The files of `model_dir` that are uploaded: the package's code, the weights (safetensors), the tokenizer, the
    configs and the card; never another .py file or a pickle."""
    code = {source.name for source in code_files()}
    return sorted(entry.name for entry in model_dir.iterdir() if entry.is_file() and (
        entry.name in code or entry.name in PUBLISHED or entry.suffix == ".safetensors"))


def left_out(model_dir: Path) -> list[str]:
    """Files of `model_dir` that are not uploaded (`published_files`), for the user to know."""
    published = set(published_files(model_dir))
    return sorted(entry.name for entry in model_dir.iterdir() if entry.is_file() and entry.name not in published)


def check_environment(scratch: str) -> dict[str, str]:
    """The loadability check's environment: this one without any variable whose name may hold a credential
    (`SECRET_NAME`), offline, with its home, Hub cache and module cache in `scratch` (so no saved token either)."""
    env = {name: value for name, value in os.environ.items() if not SECRET_NAME.search(name)}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=scratch, HF_HOME=scratch, HOME=scratch, PYTHONPATH="",
               HF_TOKEN_PATH=str(Path(scratch) / "no-token"))
    return env


def auto_map() -> dict[str, str]:
    """`auto_map` entries of the classes `diff_transformer` registers with `register_for_auto_class`."""
    return {cls._auto_class: f"{cls.__module__.rpartition('.')[2]}.{cls.__name__}" for cls in AUTO_CLASSES}


def code_files() -> set[Path]:
    """modeling_diff.py, configuration_diff.py and every sibling they import."""
    package = Path(__file__).parents[1]  # the Hub folder's files are the package's top level
    entry_points = [package / "modeling_diff.py", package / "configuration_diff.py"]
    return {*entry_points, *(Path(f) for e in entry_points for f in get_relative_import_files(str(e)))}


def stage(model_dir: Path, staged: Path, written: set[str]) -> None:
    """Links in `staged` to the folder's files that are published (`published_files`), except the files this script
    writes (written there instead)."""
    for name in published_files(model_dir):
        if name not in written:
            (staged / name).symlink_to((model_dir / name).resolve())


def install_remote_code(model_dir: Path, config: dict) -> None:
    """Copy the model code into the folder; point auto_map at it."""
    for source in code_files():
        shutil.copyfile(source, model_dir / source.name)
    config["auto_map"] = {**config.get("auto_map", {}), **auto_map()}
    config["use_cache"] = True  # Trainer saves False; clients (and ExecuTorch's export) expect the cache on
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def install_generation_config(model_dir: Path) -> None:
    """generation_config.json with the model's special tokens and a length within the context, where it lacks them."""
    if (model_dir / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(model_dir)
    else:
        generation = GenerationConfig()
    generation_defaults(generation, DiffConfig.from_pretrained(model_dir)).save_pretrained(model_dir)


def base_model(config: dict) -> str | None:
    """The checkpoint a converted model came from, if the converter noted it."""
    name = config.get("base_model") or config.get("_name_or_path")
    return name if name and not Path(name).exists() and REPO_ID.match(name) else None


def config_table(config: dict) -> str:
    rows = [f"| `{key}` | `{config[key]}` |" for key in CONFIG_ROWS if key in config]
    return "\n".join(["| field | value |", "| --- | --- |", *rows])


def train_command_details(record: dict) -> str:
    """The card's training section from training_args.json (written by `diff-transformer train`)."""
    options = dict(record.get("options", {}))
    data = options.pop("data", None)
    source = f"the text file `{Path(data).name}`" if data else "the built-in synthetic key/value retrieval task"
    rows = [f"| `--{name.replace('_', '-')}` | `{value}` |" for name, value in options.items() if value is not None]
    return "\n".join([
        f"Trained with `{record.get('command', 'diff-transformer train')}` on {source}: {record.get('steps', '?')} "
        f"optimizer steps, mean training loss {record.get('mean_training_loss', float('nan')):.4f}"
        f"{resumed_note(record)}.",
        "", "| option | value |", "| --- | --- |", *rows,
    ])


def resumed_note(record: dict) -> str:
    """Which steps the mean loss covers, where the run was resumed from a checkpoint."""
    start = record.get("resumed_from_step")
    if not start:
        return ""
    return f" (of steps {start + 1}-{record.get('steps', '?')}: resumed from the checkpoint of step {start})"


def trainer_state_details(state: dict) -> str:
    losses = [entry["loss"] for entry in state.get("log_history", []) if "loss" in entry]
    final = f", final training loss {losses[-1]:.4f}" if losses else ""
    return f"Trained with `transformers.Trainer` for {state.get('global_step', '?')} steps{final}."


def training_details(model_dir: Path) -> str:
    """What the folder records of its training: training_args.json (`diff-transformer train`), else Trainer's
    trainer_state.json, else a plain statement that it is unknown."""
    if (model_dir / "training_args.json").is_file():
        return train_command_details(read_json(model_dir / "training_args.json"))
    if (model_dir / "trainer_state.json").is_file():
        return trainer_state_details(read_json(model_dir / "trainer_state.json"))
    return ("How this model was trained (data, steps, settings) is unknown: the folder holds neither the "
            "training_args.json that `diff-transformer train` writes nor a Trainer checkpoint's trainer_state.json.")


def eval_results(model_dir: Path) -> list[EvalResult]:
    """The measurements a folder stores in eval_results.json (`diff-transformer train` writes its held-out retrieval
    accuracy there), as the card's model-index entries; none when nothing was measured."""
    path = model_dir / "eval_results.json"
    if not path.is_file():
        return []
    return [EvalResult(task_type=r["task"], dataset_type="diff-transformer/kv-retrieval", dataset_name=r["dataset"],
                       dataset_config=r.get("dataset_config"), dataset_split=r.get("split"), metric_type=r["metric"],
                       metric_value=r["value"])
            for r in read_json(path).get("results", [])]


def evaluation_details(results: list[EvalResult]) -> str:
    if not results:
        return "Nothing measured on this folder was stored with it (eval_results.json)."
    rows = [f"| {r.dataset_name} | {r.dataset_split or ''} | {r.metric_type} | {r.metric_value} |" for r in results]
    return "\n".join(["| dataset | split | metric | value |", "| --- | --- | --- | --- |", *rows])


def model_card(model_dir: Path, repo_id: str, config: dict, license: str, records: Path | None = None) -> ModelCard:
    """The card of the folder `model_dir`; what it says of training and evaluation comes from the records in
    `records` (default: `model_dir`; they are not published themselves)."""
    records = records or model_dir
    generation = GenerationConfig.from_pretrained(model_dir)
    results = eval_results(records)
    data = ModelCardData(
        model_name=repo_id.split("/")[-1] if results else None,
        eval_results=results or None,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=["diff-transformer", "differential-attention", "custom_code", "text-generation"],
        base_model=base_model(config),
    )
    body = textwrap.dedent("""
        # {name}

        A **Differential Transformer** ([arXiv 2410.05258](https://arxiv.org/abs/2410.05258)): a Llama-style decoder
        whose attention is `(softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V`, followed by a per-head RMSNorm (SubLN)
        scaled by `1 - lambda_init`. Differential attention cancels common-mode attention noise.

        ## Configuration

        {table}

        ## How to use

        Without installing anything but `transformers` (the model code ships in this repository: the files of the
        `diff_transformer` package {version}, {code}; `AutoTokenizer` reads `config.json`, so it takes the same flag,
        and loads transformers' standard fast tokenizer):

        ```python
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

        tokenizer = AutoTokenizer.from_pretrained("{repo}", trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)
        generator = pipeline("text-generation", model="{repo}", trust_remote_code=True)
        generator("Hello")  # generation_config.json: at most {max_new_tokens} new tokens (max_new_tokens=N sets it)
        ```

        LoRA without naming targets (the model code registers them with PEFT: q/k/v/o and gate/up/down projections):

        ```python
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16))
        ```

        With the `diff_transformer` package installed, no remote code is needed:

        ```python
        import diff_transformer  # registers model_type "diff_transformer" with the Auto classes
        from transformers import AutoModelForCausalLM, pipeline

        model = AutoModelForCausalLM.from_pretrained("{repo}")
        generator = pipeline("text-generation", model="{repo}")
        ```

        ## Training

        {training}

        ## Evaluation

        {evaluation}
        """)
    text = body.format(
        name=repo_id.split("/")[-1], table=config_table(config), repo=repo_id, training=training_details(records),
        evaluation=evaluation_details(results), max_new_tokens=generation.max_new_tokens, version=__version__,
        code=", ".join(f"`{name}`" for name in sorted(source.name for source in code_files())),
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{text}")


def check_remote_loading(model_dir: Path, label: Path) -> str:
    """Load as the model card does, in a fresh interpreter where `diff_transformer` cannot be imported; the tokenizer
    must be transformers' own class (no custom code). Errors name `label`, the folder the user gave."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["diff_transformer"] = None
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(model_dir)!r}, trust_remote_code=True)
        assert type(tokenizer).__module__.startswith("transformers."), f"custom tokenizer {{type(tokenizer)}}"
        ids = tokenizer("hello", return_tensors="pt")["input_ids"] % model.config.vocab_size
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all(), "non-finite logits"
        print("REMOTE_OK", type(model).__module__, type(model).__name__)
    """)
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run([sys.executable, "-c", script], cwd=scratch, env=check_environment(scratch),
                                capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if "REMOTE_OK" not in result.stdout:
        raise UploadError(f"{label} would not load with trust_remote_code=True (left unchanged):\n"
                          f"{result.stderr[-3000:]}")
    return f"it loads with trust_remote_code=True as {result.stdout.split()[-1]}"  # the class, not the module path


def require_token() -> str:
    token = get_token()  # HF_TOKEN, or the token saved by `hf auth login`
    if not token:
        raise UploadError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    return token


def upload(model_dir: Path, repo_id: str, private: bool, token: str) -> str:
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.upload_folder(repo_id=repo_id, folder_path=model_dir, commit_message="Upload DIFF Transformer",
                               allow_patterns=published_files(model_dir))
    return commit.commit_url


def prepare(model_dir: Path, repo_id: str, config: dict, license: str) -> str:
    """Write the code, config and card into a staged copy, check it loads, then copy those files into the folder."""
    written = {"config.json", "generation_config.json", "README.md", *(source.name for source in code_files())}
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch)
        stage(model_dir, staged, written)
        if (model_dir / "generation_config.json").is_file():
            shutil.copyfile(model_dir / "generation_config.json", staged / "generation_config.json")
        install_remote_code(staged, config)
        install_generation_config(staged)
        model_card(staged, repo_id, config, license, records=model_dir).save(staged / "README.md")
        checked = check_remote_loading(staged, model_dir)
        for name in written:
            shutil.copyfile(staged / name, model_dir / name)
    return checked


def publish(model_dir: Path, repo_id: str, dry_run: bool, private: bool, license: str) -> None:
    config = check_inputs(model_dir, repo_id)
    check_no_foreign_code(model_dir, config)
    token = None if dry_run else require_token()
    model_dir = model_dir.resolve()  # the check runs in another working directory
    checked = prepare(model_dir, repo_id, config, license)
    print(f"wrote {model_dir / 'README.md'} and the model code; {checked}")
    pickled = pickled_files(model_dir)
    if pickled:
        print(f"diff-transformer upload: warning: not uploading {', '.join(pickled)}: pickled files run code when "
              "loaded, and the model needs none of them (its weights are safetensors)", file=sys.stderr)
    if others := [name for name in left_out(model_dir) if name not in pickled]:
        print(f"diff-transformer upload: note: not uploading {', '.join(others)}: only the package's code, the "
              "weights, tokenizer, configs and card are published", file=sys.stderr)
    if dry_run:
        print(f"dry run: not uploading to {repo_id}")
        return
    print(f"uploaded: {upload(model_dir, repo_id, private, token)}")
