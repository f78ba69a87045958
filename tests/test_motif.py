"""Motif-2 import (diff_transformer/tools/motif.py): tiny random folders written in the publisher's format (its
config.json keys, weight names and row orders, safetensors sharded with an index) are converted and compared with a
float64 reference of the published math (motif_format.py: vLLM 0.10.2's Motif port and its differential backend,
mlx-motif's model), which reads the *unconverted* weights and uses no package code. Planted faults in the reference
(adjacent pairing, the lambda_init offset, the PolyNorm order, the GDA grouping) must each be caught. GDA folders
convert natively (the publisher's parameter count exactly, also for Motif-2-12.7B's real field list on the meta
device) or, on request, copy-expanded to plain DIFF; Motif-3-style folders are refused before any work. A converted
folder then works as any DIFF folder: generate, save / reload, LoRA with the project's defaults, and
trust_remote_code without the package. MOTIF_CHECKPOINT=FOLDER compares a real download with the publisher's code."""

import json
import os
from pathlib import Path

import pytest
import torch
from helpers.motif_format import (BASE, CASES, FAULTS, MOTIF_3, OMITTABLE, REAL_12_7B, REAL_12_7B_PARAMETERS,
                                  random_weights, reference_logits, source_shapes, write_motif_folder)

from diff_transformer import DiffForCausalLM
from diff_transformer.tools.motif import (MotifFormatError, added_parameters, convert_motif, import_motif,
                                          motif_config)

# fp32 logits of a converted model vs the float64 reference: the largest error measured over CASES is 5.4e-6
# (gda-tied; logits up to ~5, three layers with PolyNorm's cubes); a planted fault moves them by 1.3 or more.
ATOL = 2e-5

# ---- tests -----------------------------------------------------------------------------------------------------

IDS = torch.randint(0, 61, (12,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory) -> tuple[dict, dict, DiffForCausalLM, Path]:
    fields = {**BASE, **CASES[request.param]}
    weights = random_weights(fields)
    root = tmp_path_factory.mktemp(request.param)
    source = write_motif_folder(root / "motif", fields, weights)
    model = convert_motif(source, root / "diff")
    return fields, weights, model, root / "diff"


def max_error(model: DiffForCausalLM, weights: dict, fields: dict, fault: str | None = None) -> float:
    with torch.no_grad():
        logits = model(IDS[None]).logits[0].double()
    return (logits - reference_logits(weights, fields, IDS, fault)).abs().max().item()


def test_logits_match_the_float64_reference(converted):
    fields, weights, model, _ = converted
    assert model.dtype == torch.float32
    error = max_error(model, weights, fields)
    assert error < ATOL, f"converted fp32 logits vs float64 reference: max error {error:.3g}"


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_faults_are_caught(converted, fault):
    """Each fault the reference can plant (and a converter could make) moves the logits far past ATOL; a fault
    that cannot occur in a layout (GDA grouping with one signal head per group, the adjacent pairing of the GDA
    split) is skipped."""
    fields, weights, model, _ = converted
    grouped = "num_noise_heads" in fields
    if (fault == "gda_grouping") != grouped or (fault == "pairing" and grouped):
        pytest.skip(f"{fault} does not apply to this layout")
    error = max_error(model, weights, fields, fault)
    assert error > 100 * ATOL, f"{fault} planted in the reference changes the logits by only {error:.3g}"


def test_converted_folder_config_and_files(converted):
    fields, _, model, folder = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "diff_transformer" and config["hidden_act"] == "poly_norm"
    assert config["lambda_init_offset"] == -1 and config["subln_eps"] == fields["attn_rms_norm_eps"]
    assert config["embedding_multiplier"] == 1.0
    assert {"modeling_diff.py", "configuration_diff.py", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in folder.iterdir()}
    reloaded = DiffForCausalLM.from_pretrained(folder).eval()
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    with torch.no_grad():  # equal weights; only the memory layout of the loaded tensors may reorder fp32 sums
        gap = (reloaded(IDS[None]).logits - model(IDS[None]).logits).abs().max().item()
    assert gap < ATOL, f"reloaded folder's logits differ by {gap:.3g}"


def test_parameters_are_the_publishers(converted):
    """Natively converted (grouped noise heads as the source has them), the model holds exactly the source's
    parameters: no copied rows."""
    fields, weights, model, _ = converted
    assert model.num_parameters() == sum(w.numel() for w in weights.values()) and added_parameters(fields) == 0
    assert model.config.num_noise_heads == fields.get("num_noise_heads", fields["num_attention_heads"] // 2)


@pytest.mark.parametrize("case", [name for name in CASES if "gda" in name])
def test_expanded_noise_heads_give_plain_diff(tmp_path, case):
    """On request, each noise head is copied to every signal head of its group: plain DIFF, the same logits, the
    copies' parameters added; the reference's GDA-grouping fault still moves them."""
    fields = {**BASE, **CASES[case]}
    weights = random_weights(fields)
    model = import_motif(write_motif_folder(tmp_path, fields, weights), expand_noise_heads=True)
    assert model.config.num_noise_heads == model.config.num_attention_heads
    added = model.num_parameters() - sum(w.numel() for w in weights.values())
    assert added == added_parameters(fields, expand_noise_heads=True) > 0, added
    assert max_error(model, weights, fields) < ATOL
    assert max_error(model, weights, fields, "gda_grouping") > 100 * ATOL


def test_real_12_7b_config_converts_to_the_publishers_parameter_count():
    """Config only, on the meta device: Motif-2-12.7B's field list gives a GDA DiffConfig whose model has the
    publisher's 12,703,860,896 parameters (counted from its tensor shapes too); expanded, the copies' more."""
    fields = {**BASE, **REAL_12_7B}
    assert sum(torch.Size(shape).numel() for shape in source_shapes(fields).values()) == REAL_12_7B_PARAMETERS
    for expand in (False, True):
        config = motif_config(fields, expand_noise_heads=expand)
        with torch.device("meta"):
            model = DiffForCausalLM(config)
        expected = REAL_12_7B_PARAMETERS + added_parameters(fields, expand_noise_heads=expand)
        assert model.num_parameters() == expected, (expand, model.num_parameters(), expected)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert motif_config(fields).num_noise_heads == 8


def test_motif_3_is_refused_before_any_work(tmp_path, capsys):
    """A Motif-3-style folder: `convert` answers in one line naming the architecture (exit code 2, as every CLI
    refusal, tests/test_cli_inputs.py), writes nothing to OUT and leaves the source's files as they were."""
    import hashlib

    from diff_transformer_cli import main

    fields = {**BASE, **CASES["v1-mha-tied"], **MOTIF_3}
    source = write_motif_folder(tmp_path / "motif3", fields, random_weights({**BASE, **CASES["v1-mha-tied"]}))
    digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in source.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(source), str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("diff-transformer convert: error: Motif3ForCausalLM with "), lines
    assert "not supported" in lines[0] and "mixture of experts" in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert digests == {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in source.iterdir()}


def test_generate_matches_full_forwards(converted):
    """Greedy `generate` (cache) against argmax of full forwards without cache."""
    _, _, model, _ = converted
    prompt = IDS[None, :5]
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    sequence = prompt
    with torch.no_grad():
        for _ in range(6):
            sequence = torch.cat([sequence, model(sequence, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, sequence)


def test_lora_with_the_project_defaults_trains_and_merges(converted):
    """LoRA on the default targets plus the differential parameters (`DIFF_TRAINABLE_MODULES`), a few steps of one
    memorised batch: the loss falls, PolyNorm stays frozen, and the merged model gives the adapter's logits."""
    from peft import LoraConfig, get_peft_model
    from helpers.adapter_training import MERGE_ATOL, train

    from diff_transformer.peft_defaults import DIFF_TRAINABLE_MODULES, LORA_TARGET_MODULES

    _, _, model, folder = converted
    base = DiffForCausalLM.from_pretrained(folder)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           modules_to_save=list(DIFF_TRAINABLE_MODULES)))
    assert lora.peft_config["default"].target_modules == set(LORA_TARGET_MODULES)
    batch = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    losses = train(lora, batch, steps=8)
    assert losses[-1] < 0.9 * losses[0], losses
    assert not any(p.requires_grad for n, p in lora.named_parameters() if "act_fn" in n)
    lora.eval()
    with torch.no_grad():
        expected = lora(batch).logits
        merged = lora.merge_and_unload()
        gap = (merged(batch).logits - expected).abs().max().item()
    assert type(merged) is DiffForCausalLM and gap < MERGE_ATOL, gap


def test_trainer_lora_then_pipeline_on_a_converted_folder(converted, tmp_path):
    """transformers' Trainer fine-tunes a converted folder with LoRA on the project's defaults (the loss falls), and
    pipeline("text-generation") on the merged model, with a word tokenizer over the folder's vocabulary, continues a
    prompt with generate()'s greedy tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments, pipeline

    from diff_transformer.peft_defaults import DIFF_TRAINABLE_MODULES
    from diff_transformer.tokenization_diff import build_word_tokenizer

    _, _, model, folder = converted
    torch.manual_seed(0)
    lora = get_peft_model(DiffForCausalLM.from_pretrained(folder),
                          LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=list(DIFF_TRAINABLE_MODULES)))
    rows = torch.randint(3, 61, (2, 12), generator=torch.Generator().manual_seed(5)).repeat(4, 1)  # memorised
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                             use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=lora, args=args, train_dataset=data)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < 0.9 * losses[0], losses
    merged = lora.merge_and_unload().eval()
    tokenizer = build_word_tokenizer([f"w{i}" for i in range(merged.config.vocab_size - 4)])
    assert len(tokenizer) == merged.config.vocab_size
    prompt = "w3 w17 w42 w8"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = merged.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
    text = pipeline("text-generation", model=merged, tokenizer=tokenizer)(
        prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
    assert text.split() == tokenizer.decode(expected, skip_special_tokens=True).split(), (text, expected)


def test_folder_loads_with_trust_remote_code_without_the_package(converted, tmp_path):
    """The converted folder's own code (PolyNorm, the lambda offset, the SubLN epsilon) computes the reference
    logits in a fresh interpreter where `diff_transformer` cannot be imported."""
    from helpers.without_package import run_without_package

    fields, weights, _, folder = converted
    torch.save(reference_logits(weights, fields, IDS), tmp_path / "expected.pt")
    output = run_without_package(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        ids = torch.tensor([{IDS.tolist()}])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        print("MODULE", type(model).__module__)
        print("ERROR", (logits - torch.load({str(tmp_path / "expected.pt")!r})).abs().max().item())
    """, tmp_path)
    assert "transformers_modules" in output.split("MODULE ", 1)[1].split()[0], output
    assert float(output.split("ERROR ", 1)[1].split()[0]) < ATOL, output


def test_cli_converts_a_motif_folder(tmp_path, capsys):
    from diff_transformer_cli import main

    fields = {**BASE, **CASES["gda-tied"]}
    weights = random_weights(fields)
    write_motif_folder(tmp_path / "motif", fields, weights)
    for options, folder in (([], "diff"), (["--expand-noise-heads"], "expanded")):
        main(["convert", str(tmp_path / "motif"), str(tmp_path / folder), *options])
        printed = capsys.readouterr().out
        assert f"{added_parameters(fields, bool(options)):,} parameters added" in printed, printed
        model = DiffForCausalLM.from_pretrained(tmp_path / folder).eval()
        assert max_error(model, weights, fields) < ATOL
        assert (model.config.num_noise_heads < model.config.num_attention_heads) != bool(options)


def motif_fields(**overrides) -> dict:
    return {**BASE, **CASES["v1-gqa-untied-bias"], **overrides}


@pytest.mark.parametrize("overrides, named", [
    (dict(use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (dict(k_ratio=2, num_noise_heads=2), "k_ratio"),
    (dict(n_routed_experts=64), "MotifForCausalLM with mixture of experts"),
    (dict(architectures=["Motif3ForCausalLM"]), "Motif3ForCausalLM"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(scale_emb=12.0), "scale_emb"),
    (dict(use_qk_norm=True), "use_qk_norm"),
])
def test_fields_that_change_the_math_are_refused_by_name(tmp_path, overrides, named):
    fields = motif_fields(**overrides)
    write_motif_folder(tmp_path, fields, random_weights(motif_fields()))
    with pytest.raises(MotifFormatError, match=named):
        import_motif(tmp_path)


def test_unset_unknown_fields_pass_and_ignore_fields_acknowledges(tmp_path):
    fields = motif_fields(use_qk_norm=False, moe=None, wesar_weights=True)
    weights = random_weights(fields)
    write_motif_folder(tmp_path, fields, weights)
    model = import_motif(tmp_path, ignore_fields=("wesar_weights",))
    assert max_error(model, weights, fields) < ATOL


@pytest.mark.parametrize("case", ["v1-mha-tied", "gda-tied"])
def test_omitted_fields_take_the_publishers_defaults(tmp_path, case):
    """A config.json without the fields a publisher may leave out (`OMITTABLE`: the SubLN epsilon, rope_theta, the
    bias switch; num_key_value_heads where it equals the head count) converts to the logits of the float64
    reference with the defaults the public ports read: a converter default off by the SubLN epsilon's 1e-5 vs 1e-6
    moves them by ~1e-4, five times ATOL."""
    fields = {**BASE, **CASES[case]}
    assert {name: fields[name] for name in OMITTABLE} == OMITTABLE, "the reference's fields are not the defaults"
    omitted = [*OMITTABLE, *(["num_key_value_heads"] if fields["num_key_value_heads"] ==
                             fields["num_attention_heads"] else [])]
    weights = random_weights(fields)
    write_motif_folder(tmp_path, {name: value for name, value in fields.items() if name not in omitted}, weights)
    error = max_error(import_motif(tmp_path), weights, fields)
    assert error < ATOL, f"without {omitted}: converted logits vs float64 reference, max error {error:.3g}"


def test_unexpected_weight_is_named(tmp_path):
    fields = motif_fields()
    weights = {**random_weights(fields), "model.layers.0.self_attn.q_norm.weight": torch.ones(8)}
    write_motif_folder(tmp_path, fields, weights)
    with pytest.raises(MotifFormatError, match="q_norm"):
        import_motif(tmp_path)


@pytest.mark.skipif(not os.environ.get("MOTIF_CHECKPOINT"), reason="set MOTIF_CHECKPOINT to a downloaded Motif-2 "
                    "folder (its remote code runs with trust_remote_code=True)")
def test_real_checkpoint_matches_the_publishers_code(tmp_path):
    """Opt-in: logits of the converted folder against the publisher's remote code, fp32, on a short prompt."""
    from transformers import AutoModelForCausalLM

    source = os.environ["MOTIF_CHECKPOINT"]
    model = convert_motif(source, tmp_path / "diff", dtype="float32")
    publisher = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.arange(100, 132)[None]
    with torch.no_grad():
        expected, actual = publisher(ids).logits, model(ids).logits
    error = (actual - expected).abs().max().item()
    assert error < 1e-3 * expected.abs().max().item(), f"max error {error:.3g}"


def outside_shard(folder: Path, how: str) -> str:
    """A shard name pointing out of `folder` (where a copy of its first shard lies, so a reader would find it)."""
    first = folder / "model-00001-of-00002.safetensors"
    outside = folder.parent / "outside.safetensors"
    outside.write_bytes(first.read_bytes())
    if how == "link":
        (folder / "linked.safetensors").symlink_to(outside)
        return "linked.safetensors"
    return "../outside.safetensors" if how == "dotdot" else str(outside)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_shards_outside_the_folder_refused(tmp_path, how):
    """An index naming a shard outside its folder (`../`, an absolute path, a link out): refused in one line naming
    the shard, before anything is read or written (before: the file was read and converted). The command line
    answers so in a fresh interpreter with no stdin; the folders' files keep their sha256."""
    import subprocess
    import sys

    from helpers.cli import file_hashes

    fields = motif_fields()
    source = write_motif_folder(tmp_path / "motif", fields, random_weights(fields))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    name = outside_shard(source, how)
    index["weight_map"] = {key: name if shard.startswith("model-00001") else shard
                           for key, shard in index["weight_map"].items()}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MotifFormatError) as error:
        import_motif(source)
    expected = (f"{source}/model.safetensors.index.json names the shard {name!r}, which is not a file of {source}; "
                "an index lists its own folder's files: fix its weight_map")
    assert str(error.value) == expected
    if how != "dotdot":
        return
    before = file_hashes(tmp_path)
    result = subprocess.run([sys.executable, "-m", "diff_transformer_cli", "convert", str(source),
                             str(tmp_path / "out")], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=Path(__file__).parents[1])
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"diff-transformer convert: error: {expected} (--debug shows the traceback)"], result.stderr[-3000:]
    assert file_hashes(tmp_path) == before and not (tmp_path / "out").exists()
