"""A script in a fresh interpreter where `diff_transformer` cannot be imported, as a Hub user without the package
runs a saved folder's own copy of the model code; and the calls such a client makes on a folder."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Drops the repository and the editable install's import hook, so only the folder's own copy of the model code runs.
HIDE_PACKAGE = f"""
import importlib.util, sys
sys.path = [p for p in sys.path if p not in ("", {str(ROOT)!r})]
sys.meta_path = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
spec = importlib.util.find_spec("diff_transformer")
assert spec is None, f"diff_transformer is importable: {{spec}}"
"""


def run_without_package(script: str, tmp_path: Path) -> str:
    """Run `script` in a fresh interpreter without `diff_transformer` (no standard input, transformers' default log
    level); return its stdout and stderr merged in order."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": "",
           "TRANSFORMERS_VERBOSITY": "warning"}
    result = subprocess.run(
        [sys.executable, "-u", "-c", HIDE_PACKAGE + textwrap.dedent(script)], cwd=tmp_path, env=env, text=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300,
    )
    assert result.returncode == 0, result.stdout
    return result.stdout


def client_script(folder: Path, prompt: str, chat: bool) -> str:
    """The calls a user of a Hub model makes; `generated` with no generation arguments (the pipeline samples unless
    told otherwise), `greedy` with only `do_sample=False`. Prints the results as JSON."""
    pipeline_input = [{"role": "user", "content": prompt}] if chat else prompt
    return f"""
        import json
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        tokenizer = AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)
        plain = PreTrainedTokenizerFast.from_pretrained({str(folder)!r})  # reads only the tokenizer files
        print("TOKENIZER_LOADED")
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, pipeline
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        lora = get_peft_model(model, LoraConfig(r=2))
        generator = pipeline("text-generation", model={str(folder)!r}, trust_remote_code=True)
        if {chat}:
            messages = [{{"role": "user", "content": {prompt!r}}}]
            prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        else:
            prompt_ids = tokenizer({prompt!r})["input_ids"]
        result = {{
            "tokenizer": type(tokenizer).__module__,
            "model": type(model).__module__,
            "lora": sorted({{n.rsplit(".", 1)[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}}),
            "prompt_ids": prompt_ids,
            "plain_tokenizer_agrees": plain({prompt!r})["input_ids"] == tokenizer({prompt!r})["input_ids"],
            "generated": generator({pipeline_input!r}, return_tensors=True)[0]["generated_token_ids"],
            "greedy": generator({pipeline_input!r}, return_tensors=True, do_sample=False)[0]["generated_token_ids"],
            "chat_reply": generator({pipeline_input!r})[0]["generated_text"][-1] if {chat} else None,
        }}
        print("RESULT " + json.dumps(result))
    """


def client_results(folder: Path, prompt: str, chat: bool, tmp_path: Path) -> dict:
    output = run_without_package(client_script(folder, prompt, chat), tmp_path)
    before_tokenizer = output.split("TOKENIZER_LOADED")[0].strip()
    assert not before_tokenizer, f"loading the tokenizer printed:\n{before_tokenizer}"
    return json.loads(output.split("RESULT ", 1)[1])
