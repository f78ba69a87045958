"""DIFF Transformer folders served by vLLM (docs/serving.md): offline `LLM.generate` against transformers' greedy
tokens and logprobs in fp32 (short prompts and one of 4 KV blocks, chunked prefill, a prefix-cache hit, RoPE
variants), bf16 against transformers' bf16, tensor and pipeline parallelism over 2 ranks, the OpenAI-compatible
server (streaming, concurrent requests), the refusals through vLLM and through `serve`. Runs in its own venv with
the CPU build (`bash .ci/run vllm`); the default suite has no vLLM and skips this module."""

import gc
import json
import os
import shutil
import signal
import threading
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

# a submodule, not "vllm": a folder named vllm on sys.path would import as a namespace package without vLLM installed
pytest.importorskip("vllm.entrypoints.llm")
import vllm  # noqa: E402

import torch  # noqa: E402
from helpers.servers import free_port, post, wait_until_up  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

from diff_transformer import DiffConfig, DiffForCausalLM  # noqa: E402
from diff_transformer.tokenization_diff import CHAT_TEMPLATE, CHAT_TOKENS, build_word_tokenizer  # noqa: E402
from diff_transformer_cli import main as cli_main  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build needs the size said
# Offline engines run in this process (no EngineCore / Worker processes to start, each importing vLLM again), which
# keeps this module's run time down; the server test runs vLLM's processes as users do.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SERVER_ENV = dict(os.environ)
os.environ.update(IN_PROCESS)

# fp32 vLLM (paged CPU attention, its fused norms) vs transformers (sdpa / tiled kernels): the same maths in another
# order. Measured max differences are about 1e-6; a wrong mapping moves them by far more than this.
LOGPROB_TOL = 1e-4
NEW_TOKENS = 16
PROMPTS = [[1, 10, 11, 12, 13, 14, 15], [1, 40, 41, 42], [1, 70, 20, 90, 33, 34, 35, 36, 37, 38, 100]]
WORDS = [f"w{i}" for i in range(120)]
# Every engine pages the cache in blocks of 32 tokens and prefills at most 32 tokens a step, so the long prompt
# (110 tokens, 4 blocks) is prefilled in 4 chunks, and the second long prompt, which shares its first 96 tokens
# (3 full blocks), starts from the prefix cache.
BLOCK, BUDGET = 32, 32
LONG = [1] + torch.randint(3, len(WORDS), (109,), generator=torch.Generator().manual_seed(7)).tolist()
LONG_SHARED = LONG[:96] + [5, 6, 7, 8, 9, 50, 51, 52]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "block_size": BLOCK, "max_num_batched_tokens": BUDGET,
          "enable_chunked_prefill": True, "enable_prefix_caching": True, "distributed_executor_backend": "uni"}

# name -> DiffConfig fields (head_dim >= 32 unless the case is about the CPU kernel's padding); every folder but
# the one saved without the field has the default embedding_multiplier, sqrt(hidden_size)
CASES = {
    "v1_mha": {"num_attention_heads": 2},
    "v1_saved_without_multiplier": {"num_attention_heads": 2, "embedding_multiplier": 1.0, "legacy": True},
    "v1_gqa": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "v2_gqa": {"num_attention_heads": 4, "num_key_value_heads": 2, "diff_version": 2},
    # grouped noise heads (GDA): 4 noise heads for 8 differential heads, two per kv head
    "v1_gda": {"num_attention_heads": 8, "num_key_value_heads": 2, "num_noise_heads": 4},
    "hybrid": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
               "attention_types": ["differential", "standard", "differential"]},
    "hybrid_dv_d_untied": {"num_attention_heads": 2, "value_head_dim": 32, "tie_word_embeddings": False,
                           "attention_types": ["standard", "differential"], "attention_bias": True},
    "v1_d16_cpu_padded": {"num_attention_heads": 2, "head_dim": 16, "use_subln": False, "tie_word_embeddings": True},
    "v2_bias": {"num_attention_heads": 2, "diff_version": 2, "attention_bias": True, "attention_out_bias": True},
    # RoPE variants vLLM and transformers both implement (the long prompt runs past the original context of 64)
    "v1_rope_yarn": {"num_attention_heads": 2, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}},
    "v2_rope_llama3": {"num_attention_heads": 4, "num_key_value_heads": 2, "diff_version": 2, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}},
    "hybrid_rope_linear": {"num_attention_heads": 2, "attention_types": ["standard", "differential"],
                           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}},
}


def tokenizer():
    return build_word_tokenizer(WORDS, chat_template=CHAT_TEMPLATE, extra_special_tokens=CHAT_TOKENS)


def save_folder(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, legacy: bool = False,
                **fields) -> Path:
    """A tiny DIFF model with learned-looking lambdas and SubLN gains, and the chat tokenizer, saved in `dtype`;
    `legacy`: its config.json without `embedding_multiplier`, as folders were saved before the field existed."""
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
    model.to(dtype).save_pretrained(folder)
    tok.save_pretrained(folder)
    if legacy:
        saved = json.loads((folder / "config.json").read_text())
        del saved["embedding_multiplier"]
        (folder / "config.json").write_text(json.dumps(saved))
    return folder


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """transformers' log-probability of each of `tokens` after `prompt` (teacher-forced), and of its best token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()  # [N, vocab]
    logprobs = torch.log_softmax(logits, -1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist(), logprobs.max(-1).values.tolist()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability under the raw logits (as vLLM reports them)."""
    sequence = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, max_length=None)  # [1, P + N]
    tokens = sequence[0, len(prompt):].tolist()
    return tokens, hf_logprobs(model, prompt, tokens)[0]


def shut_down(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def served(outputs) -> list[tuple[list[int], list[float], int]]:
    """(tokens, logprobs, prefix-cached prompt tokens) of each request's output."""
    return [(list(o.outputs[0].token_ids),
             [entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
             o.num_cached_tokens or 0) for o in outputs]


def vllm_greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float], int]]:
    params = vllm.SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, logprobs=0)
    return served(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def new_engine(folder: Path, dtype: str = "float32", **engine) -> "vllm.LLM":
    return vllm.LLM(str(folder), dtype=dtype, seed=0, **{"enforce_eager": True, **ENGINE, **engine})


def diff_message(name: str, ours: list[float], theirs: list[float], tol: float = LOGPROB_TOL) -> str:
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    return f"{name}: logprob max diff {max(diffs):.3g}, mean {sum(diffs) / len(diffs):.3g} (tolerance {tol})"


@pytest.fixture(scope="module")
def gqa_engine(tmp_path_factory):
    """The v1_gqa folder and one engine on it, shared by the tests that need any engine."""
    folder = save_folder(tmp_path_factory.mktemp("gqa") / "v1_gqa", **CASES["v1_gqa"])
    llm = new_engine(folder)
    yield folder, llm
    shut_down(llm)


def check_case(case: str, folder: Path, llm, long: list[int] = LONG, shared: list[int] = LONG_SHARED) -> None:
    """Short prompts and the `long` one in one batch, then `shared`, which starts as `long` does: transformers'
    greedy tokens and logprobs in fp32, and a prefix-cache hit of their common full blocks."""
    first = vllm_greedy(llm, PROMPTS + [long], NEW_TOKENS)
    second = vllm_greedy(llm, [shared], NEW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs, _) in zip(PROMPTS + [long, shared], first + second):
        hf_tokens, hf_lp = hf_greedy(model, prompt, NEW_TOKENS)
        name = f"{case}, {len(prompt)}-token prompt"
        assert tokens == hf_tokens, f"{name}: vLLM {tokens} != transformers {hf_tokens}; " + diff_message(
            name, logprobs, hf_lp)
        assert max(abs(a - b) for a, b in zip(logprobs, hf_lp)) <= LOGPROB_TOL, diff_message(name, logprobs, hf_lp)
    assert len({tuple(t) for t, _, _ in first}) > 1, f"{case}: every prompt gave the same tokens; a weak test model"
    common = next(i for i, (a, b) in enumerate(zip(long, shared)) if a != b)
    hit = common // BLOCK * BLOCK  # the full blocks the two prompts share
    assert second[0][2] == hit, f"{case}: {second[0][2]} prompt tokens came from the prefix cache, not {hit}"


def test_v1_gqa_matches_transformers(gqa_engine):
    check_case("v1_gqa", *gqa_engine)


@pytest.mark.parametrize("case", [name for name in CASES if name != "v1_gqa"])
def test_offline_generate_matches_transformers(case, tmp_path):
    folder = save_folder(tmp_path / case, **CASES[case])
    llm = new_engine(folder)
    try:
        check_case(case, folder, llm)
    finally:
        shut_down(llm)


def motif_folder(root: Path, **layout) -> Path:
    """A Motif-2.6B-format folder (PolyNorm MLP with biases, GQA after the pairing, lambda_init offset -1, its own
    SubLN epsilon, untied head), or with `layout` another head layout, converted by `diff-transformer convert`
    into `root / "diff"`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers.motif_format import BASE, random_weights, write_motif_folder

    from diff_transformer.tools.motif import convert_motif

    tok = tokenizer()
    fields = {**BASE, "vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256, "use_bias": True,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **layout}
    source = write_motif_folder(root / "motif", fields, random_weights(fields, seed=1))
    tok.save_pretrained(source)
    convert_motif(source, root / "diff")
    return root / "diff"


def test_converted_motif_folder_matches_transformers(tmp_path):
    """A converted Motif folder served as any DIFF folder."""
    folder = motif_folder(tmp_path)
    llm = new_engine(folder)
    try:
        check_case("motif", folder, llm)
    finally:
        shut_down(llm)


def test_transformers_backend_is_refused(tmp_path):
    folder = save_folder(tmp_path / "v2", **CASES["v2_gqa"])
    with pytest.raises(Exception, match="cannot run on vLLM's Transformers backend"):
        vllm.LLM(str(folder), dtype="float32", model_impl="transformers", enforce_eager=True, max_model_len=128)


# bf16: vLLM and transformers round to bf16 at different points (fused GEMMs and norms, the paged kernel's
# accumulation), and the test model's large weights (initializer_range 0.3) make bf16 rounding itself move logprobs
# by up to 0.36 here (transformers' bf16 against its own fp32, teacher-forced on the same tokens). The stated
# tolerance: vLLM's bf16 logprobs are no further from transformers' bf16 than that (measured max 0.19), with a mean
# difference under BF16_MEAN_TOL (measured 0.024-0.043 per prompt); a wrong mapping moves them by whole units.
BF16_MEAN_TOL = 0.1


def test_bf16_matches_transformers_bf16(gqa_engine):
    folder, _ = gqa_engine
    llm = new_engine(folder, dtype="bfloat16")
    try:
        answers = vllm_greedy(llm, PROMPTS + [LONG, LONG_SHARED], NEW_TOKENS)
    finally:
        shut_down(llm)
    bf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, rounding = [], []
    for prompt, (tokens, logprobs, _) in zip(PROMPTS + [LONG, LONG_SHARED], answers):
        hf_lp = hf_logprobs(bf16, prompt, tokens)[0]
        ours.append([abs(a - b) for a, b in zip(logprobs, hf_lp)])
        rounding += [abs(a - b) for a, b in zip(hf_lp, hf_logprobs(fp32, prompt, tokens)[0])]
        mean = sum(ours[-1]) / len(ours[-1])
        assert mean <= BF16_MEAN_TOL, f"bf16, {len(prompt)}-token prompt: mean logprob diff {mean:.3g}"
    worst = max(max(diffs) for diffs in ours)
    assert worst <= max(rounding), (f"bf16: vLLM's logprobs differ from transformers' bf16 by up to {worst:.3g}, more "
                                    f"than transformers' bf16 from its fp32 ({max(rounding):.3g})")


def test_unimplemented_fields_refused_by_vllm(gqa_engine, tmp_path):
    """vllm.LLM on a folder whose config.json has a sliding window (or a partial rotary factor) raises, in the
    calling process and before an engine starts, the reason naming the field: DiffConfig refuses it when vLLM reads
    the config (the plugin's own check, `layout.check_fields`, says the same for configs that reach it)."""
    folder, _ = gqa_engine
    for fields in ({"sliding_window": 64}, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                "partial_rotary_factor": 0.5}}):
        edited = tmp_path / next(iter(fields))
        shutil.copytree(folder, edited)
        config = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**config, **fields}))
        with pytest.raises(Exception, match=f"{next(iter(fields))}.*(is not supported|remove)"):
            new_engine(edited)


@pytest.mark.parametrize("engine, message", [
    ({"tensor_parallel_size": 4, "distributed_executor_backend": "mp"},
     "tensor_parallel_size=4.*verified with tensor_parallel_size 1 or 2"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"},  # new_engine's default: eager
     "pipeline_parallel_size=2 with enforce_eager on vLLM's CPU build.*drop --enforce-eager"),
    ({"enable_lora": True}, "LoRA adapters are not served for DIFF models.*merge_and_unload"),
])
def test_parallelism_and_lora_refused_before_the_engine(gqa_engine, engine, message):
    with pytest.raises(Exception, match=message):
        new_engine(gqa_engine[0], **engine)


def test_chat_without_template_names_the_fix(gqa_engine):
    """What `serve` hands vLLM for a folder without a chat template: vLLM reads the string as a template (not a
    path), and a chat request through it fails with the fix instead of vLLM's generic message."""
    from vllm.renderers.chat_utils import load_chat_template

    from diff_transformer.serving.server import NO_CHAT_TEMPLATE

    assert load_chat_template(NO_CHAT_TEMPLATE) == NO_CHAT_TEMPLATE
    _, llm = gqa_engine
    with pytest.raises(Exception, match="no chat template.*diff-transformer train --chat-template"):
        llm.chat([{"role": "user", "content": "w1 w2"}], vllm.SamplingParams(max_tokens=2),
                 chat_template=NO_CHAT_TEMPLATE, use_tqdm=False)


def test_gpu_backend_table_is_vllms():
    """layout.GPU_BACKENDS restates the head widths and dtypes vLLM's CUDA attention backends declare; vLLM's
    classes import on the CPU build too, so a new vLLM that changes them fails here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from diff_transformer.serving.layout import GPU_BACKENDS

    for name, (takes, dtypes) in GPU_BACKENDS.items():
        try:
            backend = AttentionBackendEnum[name].get_class()
        except ImportError:  # FlashInfer's package is not in the CPU build
            continue
        widths = range(4, 600, 4)
        assert [w for w in widths if takes(w)] == [w for w in widths if backend.supports_head_size(w)], name
        assert {str(t).removeprefix("torch.") for t in backend.supported_dtypes} == set(dtypes), name


# Tensor and pipeline parallelism over 2 ranks, one process per rank (vLLM's CPU build runs them with its mp
# executor), one rank per core as `serve` binds them. One folder per layout: V1 MHA in a hybrid stack (standard
# layers between differential ones), V2 GQA, and a converted Motif-2-12.7B-format folder (grouped noise heads: 8
# differential heads, 2 noise heads, 2 kv heads, so each rank holds one kv head, its 4 heads and their noise head;
# PolyNorm MLP whose norms span the sharded MLP width, untied head); prompts to 171 tokens (6 blocks, 6 prefill
# chunks) and a 5-block cache hit.
LONGEST = [1] + torch.randint(3, len(WORDS), (170,), generator=torch.Generator().manual_seed(11)).tolist()
LONGEST_SHARED = LONGEST[:160] + [5, 6, 7, 8, 9, 50]
PARALLEL_CASES = {
    "hybrid_v1_mha": {"num_attention_heads": 2, "num_hidden_layers": 3,
                      "attention_types": ["differential", "standard", "differential"]},
    "v2_gqa": CASES["v2_gqa"],
}
PARALLEL = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
# the publisher's fields: 10 query heads of which 2 noise, 4 key heads (2 kv heads after the pairing)
MOTIF_GDA = {"num_attention_heads": 10, "num_key_value_heads": 4, "num_noise_heads": 2, "k_ratio": 1,
             "head_dim": 16}


@pytest.fixture(scope="module")
def parallel_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    folders = {name: save_folder(root / name, seed=3, **fields) for name, fields in PARALLEL_CASES.items()}
    return folders | {"motif_gda": motif_folder(root, **MOTIF_GDA)}


@pytest.fixture
def rank_per_core(monkeypatch):
    """Both ranks' processes pinned one per core, as `serve` pins them (`server.cpu_thread_binding`). An engine
    started in this process makes vLLM cache its environment variables; the cache is dropped on both sides."""
    from diff_transformer.serving.server import cpu_thread_binding

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(2, list(os.sched_getaffinity(0))))
    vllm.envs.disable_envs_cache()
    yield
    monkeypatch.undo()
    vllm.envs.disable_envs_cache()


# each engine costs about a minute of CI's 2 cores (a process per rank, each importing vLLM; PP compiles); every
# layout runs both: the hybrid stack's stages take their layer kinds by global index, the Motif folder's last stage
# holds its untied head
@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("case", ["hybrid_v1_mha", "v2_gqa", "motif_gda"])
def test_parallel_engine_matches_transformers(parallel_folders, rank_per_core, case, parallel):
    """Two ranks: transformers' greedy tokens and logprobs (fp32, within LOGPROB_TOL), chunked prefill and a
    prefix-cache hit, as one process gives them (check_case). Pipeline parallelism runs compiled: vLLM's CPU build
    fails in eager mode (layout.check_pipeline_mode)."""
    folder = parallel_folders[case]
    llm = new_engine(folder, distributed_executor_backend="mp", **PARALLEL[parallel], enforce_eager=parallel != "pp2")
    try:
        check_case(f"{case}, {parallel}", folder, llm, LONGEST, LONGEST_SHARED)
    finally:
        shut_down(llm)


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diff_transformer_cli", *argv], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("problem, options", [
    ("missing", ()), ("no_config", ()), ("llama", ()), ("cpu_head_size", ()),
    ("sliding_window", ("--vllm-args", "--enable-lora")),  # the first refusal: the config field
    ("ok", ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")),  # not verified together
])
def test_bad_folder_gives_one_line_error(problem, options, tmp_path):
    """`serve` refuses before vLLM starts: one line on stderr, exit status 2 (the other refusals of `serve`, by
    check_request, are in test_serving_checks.py)."""
    folder = tmp_path / "model"
    if problem == "ok":
        save_folder(folder, num_attention_heads=2, num_hidden_layers=1)
    elif problem == "sliding_window":
        save_folder(folder, num_attention_heads=2, num_hidden_layers=1)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    elif problem == "no_config":
        folder.mkdir()
    elif problem == "llama":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    elif problem == "cpu_head_size":  # V1 heads 2 * 288 wide: past the CPU kernel's largest size (512)
        save_folder(folder, hidden_size=576, num_attention_heads=1, head_dim=288, num_hidden_layers=1)
    result = run_cli("serve", str(folder), *options)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("diff-transformer serve: error:"), (
        result.stderr[-2000:])


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
    """A folder saved by `diff-transformer train` (tiny, chat template; default head_dim 8, which the CPU build runs
    padded to its 32-wide heads), trained long enough that the prompts below get different greedy answers (after
    20 or 60 steps, with the scaled embeddings of the default, every prompt gets the same ones)."""
    folder = tmp_path_factory.mktemp("trained") / "diff-tiny"
    cli_main(["train", "--max-steps", "150", "--examples", "300", "--output", str(folder), "--chat-template",
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


def stream(port: int, body: dict) -> tuple[list[int], int]:
    """The token ids of a streamed /v1/completions answer (server-sent events) and the number of chunks."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    ids, chunks = [], 0
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                ids += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
    return ids, chunks


def concurrently(port: int, bodies: list[dict]) -> list[dict]:
    """Each body POSTed to /v1/completions from its own thread, all at once."""
    answers = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = post(port, "/v1/completions", bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return answers


def test_server_answers_openai_requests_like_pipeline(trained_folder, tmp_path):
    """Acceptance 1: `diff-transformer serve` on a trained folder (default --dtype auto: the folder's float32;
    `--vllm-args "--enforce-eager"`, a value starting with a dash) answers /v1/completions and
    /v1/chat/completions (the folder's chat template) with pipeline's prompt and greedy tokens, streams the same
    tokens, and answers concurrent requests as it answers each alone; the server is stopped by its PID."""
    port, log = free_port(), tmp_path / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen([sys.executable, "-m", "diff_transformer_cli", "serve", str(trained_folder),
                                   "--port", str(port), "--served-model-name", "diff", "--max-model-len", "128",
                                   "--vllm-args", "--enforce-eager"], stdout=sink, stderr=subprocess.STDOUT,
                                  env=SERVER_ENV)
    request = {"model": "diff", "max_tokens": 4, "min_tokens": 4, "temperature": 0, "return_token_ids": True}
    prompts = [f"k{i} v{i + 1} k{i + 2} v{i + 3} ? k{i}" for i in range(1, 7)]
    try:
        wait_until_up(server, port, log)
        messages = [{"role": "user", "content": prompts[0]}]
        completion = post(port, "/v1/completions", {**request, "prompt": prompts[0]})
        chat = post(port, "/v1/chat/completions", {**request, "messages": messages})
        streamed, chunks = stream(port, {**request, "prompt": prompts[0]})
        alone = [post(port, "/v1/completions", {**request, "prompt": p}) for p in prompts]
        together = concurrently(port, [{**request, "prompt": p} for p in prompts])
    finally:
        stop(server)
    assert "--dtype float32" in log.read_text(), "--dtype auto must serve the float32 folder in float32"
    for name, answer, sent in (("completion", completion, prompts[0]), ("chat", chat, messages)):
        prompt_ids, new_ids = pipeline_tokens(trained_folder, sent, 4)
        served = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        assert served == prompt_ids, f"{name}: vLLM's prompt {served} != the tokenizer's {prompt_ids}"
        assert answer["choices"][0]["token_ids"] == new_ids, f"{name}: vLLM {answer['choices'][0]} != {new_ids}"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    # streamed: more than one chunk (vLLM coalesces tokens into one delta when its server loop falls behind, as on
    # a loaded machine: 3 chunks for 4 tokens seen)
    assert streamed == completion["choices"][0]["token_ids"] and chunks >= 2, (streamed, chunks)
    assert [a["choices"][0]["token_ids"] for a in together] == [a["choices"][0]["token_ids"] for a in alone]
    assert len({tuple(a["choices"][0]["token_ids"]) for a in alone}) > 1, "every prompt gave the same tokens"
    assert server.returncode is not None


def test_tokenizer_chat_template_is_the_folders(trained_folder):
    assert AutoTokenizer.from_pretrained(trained_folder).chat_template == CHAT_TEMPLATE
