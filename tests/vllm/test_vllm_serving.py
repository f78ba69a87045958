"""DIFF Transformer folders served by vLLM (issue #31; docs/serving.md): offline `LLM.generate` against transformers'
greedy tokens and logprobs in fp32, the OpenAI-compatible server, the refusals. Runs in its own venv with the CPU
build (`bash .ci/run vllm`); the default suite has no vLLM and skips this module."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# a submodule, not "vllm": without vLLM installed, this folder (tests/vllm, on sys.path) imports as a namespace package
pytest.importorskip("vllm.entrypoints.llm")
import vllm  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

from diff_transformer import DiffConfig, DiffForCausalLM  # noqa: E402
from diff_transformer.tools.tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, build_word_tokenizer  # noqa: E402
from diff_transformer_cli import main as cli_main  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build needs the size said

# fp32 vLLM (paged CPU attention, its fused norms) vs transformers (sdpa / tiled kernels): the same maths in another
# order. Measured max differences are about 1e-6; a wrong mapping moves them by far more than this.
LOGPROB_TOL = 1e-4
NEW_TOKENS = 16
PROMPTS = [[1, 10, 11, 12, 13, 14, 15], [1, 40, 41, 42], [1, 70, 20, 90, 33, 34, 35, 36, 37, 38, 100]]
WORDS = [f"w{i}" for i in range(120)]
SERVER_START_S = 240

# name -> DiffConfig fields (head_dim >= 32 unless the case is about the CPU kernel's padding)
CASES = {
    "v1_mha": {"num_attention_heads": 2},
    "v1_gqa": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "v2_gqa": {"num_attention_heads": 4, "num_key_value_heads": 2, "diff_version": 2},
    "hybrid": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
               "attention_types": ["differential", "standard", "differential"]},
    "hybrid_dv_d_untied": {"num_attention_heads": 2, "value_head_dim": 32, "tie_word_embeddings": False,
                           "attention_types": ["standard", "differential"], "attention_bias": True},
    "v1_d16_cpu_padded": {"num_attention_heads": 2, "head_dim": 16, "use_subln": False, "tie_word_embeddings": True},
}


def tokenizer():
    return build_word_tokenizer(WORDS, chat_template=CHAT_TEMPLATE, extra_special_tokens=CHAT_TOKENS)


def save_folder(folder: Path, seed: int = 0, **fields) -> Path:
    """A tiny fp32 DIFF model with learned-looking lambdas and SubLN gains, and the chat tokenizer, saved."""
    tok = tokenizer()
    torch.manual_seed(seed)
    config = DiffConfig(**{
        "vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "head_dim": 32, "max_position_embeddings": 256, "initializer_range": 0.3, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        **fields,
    })
    model = DiffForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("subln.weight"):
                param.add_(0.3 * torch.randn_like(param))
            elif "lambda_params" in name:
                param.normal_(0, 0.3)
            elif name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability under the raw logits (as vLLM reports them)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    sequence = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, max_length=None)  # [1, P + N]
    tokens = sequence[0, len(prompt):]
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()  # [N, vocab]: the logits of each new token
    logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def vllm_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, **engine) -> list[tuple[list, list]]:
    """vLLM's greedy tokens and logprobs for each prompt, from a fresh fp32 engine that is shut down after."""
    llm = vllm.LLM(str(folder), dtype="float32", seed=0, max_model_len=128, max_num_seqs=4, enforce_eager=True,
                   **engine)
    try:
        params = vllm.SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def diff_message(name: str, ours: list[float], theirs: list[float]) -> str:
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    return f"{name}: logprob max diff {max(diffs):.3g}, mean {sum(diffs) / len(diffs):.3g} (tolerance {LOGPROB_TOL})"


@pytest.mark.parametrize("case", list(CASES))
def test_offline_generate_matches_transformers(case, tmp_path):
    folder = save_folder(tmp_path / case, **CASES[case])
    served = vllm_greedy(folder, PROMPTS, NEW_TOKENS)
    for prompt, (tokens, logprobs) in zip(PROMPTS, served):
        hf_tokens, hf_logprobs = hf_greedy(folder, prompt, NEW_TOKENS)
        assert tokens == hf_tokens, f"{case}: vLLM {tokens} != transformers {hf_tokens}; " + diff_message(
            case, logprobs, hf_logprobs)
        assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs)) <= LOGPROB_TOL, diff_message(
            case, logprobs, hf_logprobs)
    assert len({tuple(t) for t, _ in served}) > 1, f"{case}: every prompt gave the same tokens; a weak test model"


def test_transformers_backend_is_refused(tmp_path):
    folder = save_folder(tmp_path / "v2", **CASES["v2_gqa"])
    with pytest.raises(Exception, match="cannot run on vLLM's Transformers backend"):
        vllm.LLM(str(folder), dtype="float32", model_impl="transformers", enforce_eager=True, max_model_len=128)


def test_unverified_tensor_parallel_is_refused(tmp_path):
    from diff_transformer.serving.layout import check_servable

    config = DiffConfig.from_pretrained(save_folder(tmp_path / "v1", **CASES["v1_gqa"]))
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*serve with tensor_parallel_size=1"):
        check_servable(config, tensor_parallel_size=2)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diff_transformer_cli", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("problem", ["missing", "no_config", "llama", "cpu_head_size"])
def test_bad_folder_gives_one_line_error(problem, tmp_path):
    folder = tmp_path / "model"
    if problem == "no_config":
        folder.mkdir()
    elif problem == "llama":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif problem == "cpu_head_size":  # V1 heads 2 * 288 wide: past the CPU kernel's largest size (512)
        save_folder(folder, hidden_size=576, num_attention_heads=1, head_dim=288, num_hidden_layers=1)
    result = run_cli("serve", str(folder))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("diff-transformer serve: error:"), (
        result.stderr[-2000:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_until_up(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"no server on port {port} after {SERVER_START_S} s: {log.read_text()[-3000:]}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's PID (vLLM then ends its engine process), SIGKILL if it lingers."""
    if server.poll() is not None:
        return
    os.kill(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.kill(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory) -> Path:
    """A folder saved by `diff-transformer train` (tiny, a few steps, chat template; default head_dim 8, which the
    CPU build runs padded to its 32-wide heads)."""
    folder = tmp_path_factory.mktemp("trained") / "diff-tiny"
    cli_main(["train", "--max-steps", "20", "--examples", "300", "--output", str(folder), "--chat-template",
              "--max-new-tokens", "2"])
    return folder


def pipeline_tokens(folder: Path, prompt: list[dict] | str, new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy new ids) of `pipeline("text-generation")`, as `diff-transformer generate` calls it, with
    `new_tokens` tokens exactly (a 20-step model may end its turn at once)."""
    generator = pipeline("text-generation", model=str(folder))
    output = generator(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       return_tensors=True)[0]["generated_token_ids"]
    tokenizer = generator.tokenizer
    prompt_ids = (tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
                  ["input_ids"] if isinstance(prompt, list) else tokenizer(prompt)["input_ids"])
    assert list(output[: len(prompt_ids)]) == list(prompt_ids), "pipeline's output must start with the prompt"
    return list(prompt_ids), list(output[len(prompt_ids):])


def test_server_answers_openai_requests_like_pipeline(trained_folder, tmp_path):
    """Acceptance 1: `diff-transformer serve` on a trained folder answers /v1/completions and /v1/chat/completions
    (the folder's chat template) with pipeline's prompt and greedy tokens; the server is stopped by its PID."""
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen([sys.executable, "-m", "diff_transformer_cli", "serve", str(trained_folder),
                                   "--port", str(port), "--dtype", "float32", "--served-model-name", "diff",
                                   "--max-model-len", "128", "--vllm-args", "--enforce-eager --seed 0"],
                                  stdout=sink, stderr=subprocess.STDOUT)
    request = {"model": "diff", "max_tokens": 4, "min_tokens": 4, "temperature": 0, "return_token_ids": True}
    try:
        wait_until_up(server, port, log)
        prompt = "k1 v2 k3 v4 ? k1"
        messages = [{"role": "user", "content": prompt}]
        completion = post(port, "/v1/completions", {**request, "prompt": prompt})
        chat = post(port, "/v1/chat/completions", {**request, "messages": messages})
    finally:
        stop(server)
    for name, answer, sent in (("completion", completion, prompt), ("chat", chat, messages)):
        prompt_ids, new_ids = pipeline_tokens(trained_folder, sent, 4)
        served = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        assert served == prompt_ids, f"{name}: vLLM's prompt {served} != the tokenizer's {prompt_ids}"
        assert answer["choices"][0]["token_ids"] == new_ids, f"{name}: vLLM {answer['choices'][0]} != {new_ids}"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert server.returncode is not None


def test_tokenizer_chat_template_is_the_folders(trained_folder):
    assert AutoTokenizer.from_pretrained(trained_folder).chat_template == CHAT_TEMPLATE
