"""The checks `diff-transformer serve` and the vLLM plugin make before any engine starts (docs/serving.md): config
fields vLLM would apply differently, the serve command's options, parallelism and LoRA, the GPU attention backends'
head sizes, the advice for weights that are not plain, the chat-template message. They need no vLLM, so this module
runs in every test pass; tests/vllm_serving/test_vllm_serving.py runs the same refusals through vLLM itself."""

import json
from pathlib import Path

import pytest
import torch

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.serving import layout, server
from diff_transformer.tokenization_diff import build_word_tokenizer
from diff_transformer_cli import build_parser

WORDS = [f"w{i}" for i in range(40)]


def save_folder(folder: Path, dtype: torch.dtype = torch.float32, **fields) -> Path:
    tok = build_word_tokenizer(WORDS)
    config = DiffConfig(**{"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 1, "head_dim": 32, **fields})
    DiffForCausalLM(config).to(dtype).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_folder(tmp_path_factory.mktemp("serve") / "model")


def edited(folder: Path, tmp_path: Path, **fields) -> Path:
    """A copy of `folder` whose config.json has `fields` written in (as a user or another tool would)."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **fields}))
    return copy


def serve_args(folder: Path, *options: str):
    return build_parser().parse_args(["serve", str(folder), *options])


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("fields, named", [
    ({"sliding_window": 64}, "sliding_window=64"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.25}}, "rope_parameters.partial_rotary_factor=0.25"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "rope_scaling.partial_rotary_factor=0.5"),
    # vLLM gave a 7-token prompt batched with a 110-token one other tokens (logprobs off by 1.9): it applies the
    # long factors to the whole batch once one request passes original_max_position_embeddings
    ({"rope_parameters": {**ROPE, "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                          "original_max_position_embeddings": 64}}, "rope_parameters.rope_type=longrope"),
])
def test_fields_vllm_would_apply_are_refused(folder, tmp_path, fields, named):
    """vLLM applies a sliding window and a partial rotary factor; transformers' DIFF model implements neither, so
    vLLM's tokens would differ from the first token on a long prompt; vLLM's longrope depends on the batch. `serve`
    refuses them naming the field."""
    with pytest.raises(ValueError, match=f"config.json sets {named}.*remove the field"):
        server.check_folder(str(edited(folder, tmp_path, **fields)))


@pytest.mark.parametrize("fields", [{}, {"sliding_window": None}, {"sliding_window": 0},
                                    {"partial_rotary_factor": 1.0}, {"rope_parameters": {**ROPE}},
                                    {"rope_parameters": {"full_attention": {**ROPE, "partial_rotary_factor": 1}}}])
def test_fields_that_change_nothing_pass(fields):
    assert layout.unimplemented_fields(fields) == []


def test_quantized_folder_gets_quantization_advice(folder, tmp_path):
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4}}
    with pytest.raises(ValueError, match="quantization_config \\(gptq\\).*unquantized weights only") as error:
        server.check_folder(str(edited(folder, tmp_path, **config)))
    assert "re-save" not in str(error.value)


@pytest.mark.parametrize("name, advice", [
    ("model.layers.0.self_attn.q_proj.qweight", "looks quantized.*serve the unquantized folder"),
    ("model.layers.0.mlp.down_proj.weight_scale", "looks quantized"),
    ("model.layers.0.self_attn.q_proj.absmax", "looks quantized"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "PEFT adapter weight.*merge_and_unload"),
    ("model.layers.7.self_attn.q_proj.weight", "do not fit its config.json"),
])
def test_unexpected_weight_advice_fits_its_kind(name, advice):
    error = layout.unexpected_weight(name)
    assert name in str(error)
    assert __import__("re").search(advice, str(error)), str(error)


@pytest.mark.parametrize("options, value", [
    (["--vllm-args", "--enforce-eager"], "--enforce-eager"),  # argparse alone: "expected one argument"
    (["--vllm-args=--enforce-eager"], "--enforce-eager"),
    (["--vllm-args", "--seed 0 --enforce-eager", "--port", "9001"], "--seed 0 --enforce-eager"),
    (["--vllm-args=--max-num-seqs=4"], "--max-num-seqs=4"),
])
def test_vllm_args_value_may_start_with_a_dash(folder, options, value):
    args = serve_args(folder, *options)
    assert args.vllm_args == value
    command = server.server_command(args, "float32")
    assert command[command.index("--dtype") + 1] == "float32"
    assert command[-len(value.split()):] == value.split()


def test_dtype_auto_keeps_the_folders_dtype_on_cpu(folder, tmp_path, capsys):
    """vLLM's own `auto` serves a float32 folder in bfloat16 on a CPU; `serve` keeps the folder's dtype there, and
    says on a GPU that vLLM's choice differs from float32."""
    assert server.serving_dtype(serve_args(folder), cpu=True) == "float32"
    assert "serving in float32, the folder's dtype" in capsys.readouterr().out
    bf16 = save_folder(tmp_path / "bf16", dtype=torch.bfloat16)
    assert server.serving_dtype(serve_args(bf16), cpu=True) == "bfloat16"
    assert server.serving_dtype(serve_args(folder, "--dtype", "bfloat16"), cpu=True) == "bfloat16"
    assert server.serving_dtype(serve_args(folder), cpu=False) == "auto"
    assert "--dtype float32 to keep float32" in capsys.readouterr().err


NOT_VERIFIED = "verified with tensor_parallel_size 1 or 2, or pipeline_parallel_size 1 or 2, not both above 1"


@pytest.mark.parametrize("options, message", [
    (["--vllm-args=--tensor-parallel-size 4"], f"tensor_parallel_size=4, pipeline_parallel_size=1: .*{NOT_VERIFIED}"),
    (["--vllm-args=-tp=4"], "tensor_parallel_size=4"),
    (["--pipeline-parallel-size", "3"], "pipeline_parallel_size=3: .*serve with one of those"),
    (["--tensor-parallel-size", "2", "--vllm-args=-pp 2"], "tensor_parallel_size=2, pipeline_parallel_size=2: "),
    # the folder's one kv head cannot be split over 2 ranks
    (["--tensor-parallel-size", "2"], "needs num_key_value_heads \\(1\\) divisible by tensor_parallel_size"),
    (["--tensor-parallel-size", "2", "--vllm-args=-tp 2"], "--tensor-parallel-size is given twice"),
    (["--vllm-args=--enable-lora"], "LoRA adapters are not served.*merge_and_unload"),
    (["--vllm-args=--lora-modules a=/x"], "LoRA adapters are not served"),
])
def test_parallelism_and_lora_refused_before_start(folder, options, message):
    with pytest.raises(ValueError, match=message):
        server.check_request(serve_args(folder, *options), cpu=True)


@pytest.fixture(scope="module")
def two_kv_heads(tmp_path_factory) -> Path:
    return save_folder(tmp_path_factory.mktemp("kv2") / "model", hidden_size=128, num_attention_heads=2)


@pytest.mark.parametrize("options, sizes, flags", [
    ([], (1, 1), []),
    (["--tensor-parallel-size", "2"], (2, 1), ["--tensor-parallel-size", "2"]),
    (["--pipeline-parallel-size", "2"], (1, 2), ["--pipeline-parallel-size", "2"]),
    (["--vllm-args=-tp 2"], (2, 1), ["-tp", "2"]),  # vLLM's own spelling, passed on as given
])
def test_parallel_sizes_reach_vllm_once(two_kv_heads, options, sizes, flags):
    """`serve --tensor-parallel-size / --pipeline-parallel-size` (or vLLM's options in --vllm-args) are checked
    against the folder and given to vLLM's server once."""
    args = serve_args(two_kv_heads, *options)
    _, vllm_options = server.check_request(args, cpu=True)
    assert tuple(server.parallel_sizes(args, vllm_options).values()) == sizes
    command = server.server_command(args, "float32")
    assert command[command.index("float32") + 1:] == flags


@pytest.mark.parametrize("ranks, cores, binding", [
    (2, [0, 1], "0|1"),
    (2, [1, 0], "0|1"),
    (2, [0, 1, 2, 3, 4, 5, 6, 7], "0,1,2,3|4,5,6,7"),
    (2, [4, 6, 9], "4|6"),  # an odd core left over
    (1, [0, 1], "0,1"),
])
def test_cpu_thread_binding_gives_each_rank_its_cores(ranks, cores, binding):
    """VLLM_CPU_OMP_THREADS_BIND as `serve` sets it on the CPU build: disjoint core groups, one per rank (vLLM's
    own default binds ranks to NUMA nodes, and this machine has one)."""
    assert server.cpu_thread_binding(ranks, cores) == binding


@pytest.mark.parametrize("options, env, binding", [
    (["--tensor-parallel-size", "2"], {}, "0|1"),
    (["--vllm-args=--pipeline-parallel-size 2"], {}, "0|1"),
    (["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "1|0"}, "1|0"),  # the user's, kept
    ([], {}, None),  # one process: vLLM's own default
])
def test_serve_binds_one_rank_per_core_unless_told(two_kv_heads, options, env, binding):
    """The environment `serve` hands vLLM's CPU build: the KV-cache size and, with several ranks and no binding of
    the user's, one core group per rank."""
    args = serve_args(two_kv_heads, "--kv-cache-gib", "2", *options)
    _, vllm_options = server.check_request(args, cpu=True)
    served = server.cpu_environment(args, vllm_options, {"PATH": "/bin", **env}, [0, 1])
    assert served.get("VLLM_CPU_OMP_THREADS_BIND") == binding
    assert served["VLLM_CPU_KVCACHE_SPACE"] == "2" and served["PATH"] == "/bin"


def test_cpu_thread_binding_refuses_more_ranks_than_cores():
    with pytest.raises(ValueError, match="4 ranks .*need a core each.*may run on 2; serve with fewer ranks"):
        server.cpu_thread_binding(4, [0, 1])


def test_adapter_folder_is_refused_with_merge_advice(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "modules_to_save": ["lambda_params", "subln"]}))
    with pytest.raises(ValueError, match="holds a PEFT adapter.*merge_and_unload\\(\\).save_pretrained"):
        server.check_folder(str(adapter))


def widths(**fields) -> dict[str, int]:
    return layout.gpu_widths(DiffConfig(hidden_size=256, num_attention_heads=2, **fields))


@pytest.mark.parametrize("fields, dtype, backend", [
    ({"head_dim": 64}, "bfloat16", "FLASH_ATTN"),  # V1: 2d = 128
    ({"head_dim": 128}, "bfloat16", "FLASH_ATTN"),  # 2d = 256, FlashAttention's widest
    ({"head_dim": 256}, "bfloat16", "FLASHINFER"),  # 2d = 512: past FlashAttention
    ({"head_dim": 256}, "float32", "TRITON_ATTN"),  # no FlashAttention / FlashInfer in float32
    ({"head_dim": 12}, "bfloat16", "FLASH_ATTN"),  # 2d = 24, divisible by 8
    ({"head_dim": 10}, "bfloat16", "FLEX_ATTENTION"),  # 2d = 20: not divisible by 8, under Triton's 32
    ({"head_dim": 8}, "float32", "FLEX_ATTENTION"),  # `diff-transformer train`'s default in float32
    ({"head_dim": 64, "diff_version": 2}, "float16", "FLASH_ATTN"),  # V2: d = 64
    ({"head_dim": 64, "attention_types": ["standard", "differential"], "num_hidden_layers": 2}, "bfloat16",
     "FLASH_ATTN"),  # hybrid: 64 and 128
])
def test_gpu_backend_for_head_widths(fields, dtype, backend):
    """vLLM on CUDA picks the first backend, in its order, that takes the heads; `serve` says so when that is not
    FlashAttention, and refuses a backend chosen with --attention-backend that cannot run them."""
    found = widths(**fields)
    assert layout.gpu_backends(found, dtype)[0] == backend
    note = layout.gpu_backend_note(found, dtype)
    if backend == "FLASH_ATTN":
        assert note is None
    else:
        assert f"vLLM will run {backend}" in note and "FlashAttention takes widths divisible by 8 up to 256" in note
        with pytest.raises(ValueError, match="--attention-backend FLASH_ATTN cannot run this model's heads"):
            layout.gpu_backend_note(found, dtype, selected="FLASH_ATTN")


def test_gpu_widths_are_the_natural_ones():
    """On a GPU no head is padded: V1 2d (or dv when wider), V2 d, standard d in a hybrid with V1 layers; only the
    layer kinds the stack has count."""
    assert widths(head_dim=256) == {"differential": 512}
    assert widths(head_dim=32, value_head_dim=96) == {"differential": 96}
    assert widths(head_dim=16, diff_version=2) == {"differential": 16}
    hybrid = {"num_hidden_layers": 2, "attention_types": ["standard", "differential"]}
    assert widths(head_dim=16, **hybrid) == {"differential": 32, "standard": 16}


def test_no_chat_template_message(tmp_path):
    """A folder without a chat template: `serve` gives vLLM a template whose rendering fails with the fix, so that
    /v1/chat/completions answers it (tests/vllm_serving/test_vllm_serving.py checks it through the server)."""
    plain = save_folder(tmp_path / "plain")
    assert not server.has_chat_template(str(plain))
    tok = build_word_tokenizer(WORDS)
    with pytest.raises(Exception, match="no chat template.*diff-transformer train --chat-template"):
        tok.apply_chat_template([{"role": "user", "content": "w1"}], chat_template=server.NO_CHAT_TEMPLATE)


def test_poly_norm_serves_on_two_ranks():
    """PolyNorm normalises over the whole MLP width, which tensor parallelism shards: each rank all-reduces the
    norms' statistics (vllm_model.ShardedPolyNorm), so 2 ranks pass the checks like one process."""
    config = DiffConfig(hidden_size=128, intermediate_size=192, num_attention_heads=4, head_dim=16,
                        hidden_act="poly_norm", lambda_init_offset=-1)
    assert layout.check_servable(config, tensor_parallel_size=2) == layout.check_servable(config)
    assert layout.check_servable(config) == {"differential": 32, "standard": 32}


KEY = "sk-planted-4f1c"  # a key no other text of the command contains


@pytest.mark.parametrize("given", ["vllm-args", "vllm-args=", "file", "environment"])
def test_api_key_only_in_the_servers_environment(folder, tmp_path, given):
    """However the key is given, vLLM gets it as VLLM_API_KEY in its environment: the command `serve` prints and
    execs (what `ps` shows once vLLM runs) holds no key (before: `--vllm-args "--api-key K"` was printed and stayed
    in vLLM's argv), and the other vLLM options are kept."""
    (tmp_path / "key").write_text(f"{KEY}\n")
    options = {"vllm-args": ["--vllm-args", f"--seed 0 --api-key {KEY} --enforce-eager"],
               "vllm-args=": ["--vllm-args", f"--api-key={KEY} --seed 0 --enforce-eager"],
               "file": ["--api-key-file", str(tmp_path / "key"), "--vllm-args", "--seed 0 --enforce-eager"],
               "environment": ["--vllm-args", "--seed 0 --enforce-eager"]}[given]
    environ = {"PATH": "/usr/bin", **({"VLLM_API_KEY": KEY} if given == "environment" else {})}
    command, env = server.launch(serve_args(folder, *options), "float32", None, environ, cpu=True)
    assert env["VLLM_API_KEY"] == KEY and env["VLLM_CPU_KVCACHE_SPACE"] == "1", env
    assert not [arg for arg in command if KEY in arg or "api-key" in arg], command
    assert command[-3:] == ["--seed", "0", "--enforce-eager"], command


def test_api_key_mistakes_and_exposure(folder, tmp_path):
    """A key given twice or an empty key file: one line, before vLLM is imported. A --host other than loopback
    without a key warns that anyone on the network can use the server; with one, that it needs TLS; the default
    bind (127.0.0.1) says nothing."""
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "key").write_text(KEY)
    with pytest.raises(ValueError, match=r"^an API key in both --api-key-file and --vllm-args; give it once"):
        server.api_key(serve_args(folder, "--api-key-file", str(tmp_path / "key"), f"--vllm-args=--api-key {KEY}"),
                       {})
    with pytest.raises(ValueError, match=rf"^--api-key-file {tmp_path / 'empty'} is empty; write the key"):
        server.api_key(serve_args(folder, "--api-key-file", str(tmp_path / "empty")), {})
    with pytest.raises(ValueError, match=r"--api-key-file .*/nope: cannot read it \(No such file or directory\)"):
        server.api_key(serve_args(folder, "--api-key-file", str(tmp_path / "nope")), {})
    assert server.exposure_note(serve_args(folder), {}) is None
    assert server.exposure_note(serve_args(folder, "--host", "0.0.0.0"), {}).startswith(
        "warning: --host 0.0.0.0 exposes the server to the network without an API key")
    exposed = server.exposure_note(serve_args(folder, "--host", "0.0.0.0"), {"VLLM_API_KEY": KEY})
    assert exposed.startswith("note: --host 0.0.0.0: clients must send the API key (from VLLM_API_KEY)")
    assert KEY not in exposed
