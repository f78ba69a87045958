"""DiffConfig: its fields' checks, typos and bad values in code or in config.json, and how other tools handle it.

Bad values answer in one line naming the field: wrong types and sizes, given in code or in an edited config.json,
raise ValueError before anything is built, not a TypeError from deep inside; a misspelt field names the one meant.
DiffConfig is pickled by value as vLLM ships remote-code configs to its workers, and checked by transformers' own rope
validation as LlamaConfig is, except that what it only logs is refused. Fields the model does not implement (a
sliding window, partial rotary embeddings) are refused in code and in config.json."""

import json
import logging
import math
import pickle
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import tiny_config
from transformers import AutoConfig, LlamaConfig

from diff_transformer import DiffConfig, config_checks, configuration_diff, saved_folder

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
# A worker that cannot import diff_transformer: the class it unpickles must have come by value.
LOAD_WITHOUT_PACKAGE = """
import pickle, sys
sys.modules["diff_transformer"] = None
cls, config = pickle.loads(sys.stdin.buffer.read())
built = cls(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2)
print(cls.__name__, config.num_hidden_layers, config.attention_types, built.head_dim)
"""


def test_instance_pickles():
    config = tiny_config(attention_types=["differential", "standard"], lambda_init=0.3)
    loaded = pickle.loads(pickle.dumps(config))
    assert loaded.to_dict() == config.to_dict(), "a pickled DiffConfig comes back with other fields"


def test_module_state_pickles():
    """cloudpickle pickles the class by value with every module-level value its methods read."""
    for name, value in vars(configuration_diff).items():
        if not name.startswith("__") and not isinstance(value, types.ModuleType):
            try:
                pickle.dumps(value)
            except TypeError as error:
                pytest.fail(f"configuration_diff.{name} does not pickle ({error}): the class cannot ship by value")


def test_class_pickles_by_value():
    """vLLM registers the whole package of a remote-code folder's modules by value: the configuration module and
    the siblings it imports (config_checks.py, saved_folder.py) travel together."""
    cloudpickle = pytest.importorskip("cloudpickle")
    modules = (configuration_diff, config_checks, saved_folder)
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        blob = cloudpickle.dumps((DiffConfig, tiny_config(lambda_init=0.3)))
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PACKAGE], input=blob, capture_output=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().split() == ["DiffConfig", "2", "['differential',", "'differential']", "4"], result


def test_typo_check_after_a_load(tmp_path):
    """The saved-keys exemption holds for that load only: a config built in code afterwards is checked again."""
    saved = tiny_config()
    saved.batch_norm_eps = 1e-5
    saved.save_pretrained(tmp_path)
    assert DiffConfig.from_pretrained(tmp_path).batch_norm_eps == 1e-5
    with pytest.raises(ValueError, match="unknown field 'num_heads'"):
        DiffConfig(num_heads=4)
    assert not hasattr(DiffConfig.from_pretrained(tmp_path), configuration_diff.LOADING_SAVED)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rope_warnings(build: Callable[[], object]) -> list[str]:
    """What transformers' rope validation logs while `build` runs (the tests run at verbosity error)."""
    logger = logging.getLogger("transformers.modeling_rope_utils")
    records, level = Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.WARNING)
    try:
        build()
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return records.messages


def reload_with(config_class: type, rope_scaling: dict) -> Callable[[], object]:
    """A saved config with other rope parameters read back, as transformers' common test
    `test_model_loading_old_rope_configs` reads it."""
    saved = config_class(**SIZES).to_dict()
    return lambda: config_class.from_dict({**saved, "rope_scaling": dict(rope_scaling)})


INVALID_ROPE = {  # rope_scaling: what transformers' validation says of it (LlamaConfig logs it as a warning)
    "negative-linear-factor": ({"rope_type": "linear", "factor": -999.0}, "factor field must be a float or int >= 1"),
    "dynamic-factor-below-1": ({"type": "dynamic", "factor": 0.5}, "factor field must be a float or int >= 1"),
    "llama3-frequencies": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                            "original_max_position_embeddings": 64}, "high_freq_factor field must be greater"),
}


@pytest.mark.parametrize("name", INVALID_ROPE)
def test_invalid_rope_refused_where_llama_warns(name, tmp_path):
    """The same problems transformers' validation finds for LlamaConfig, refused at construction and at load: a
    linear factor of -999 scales every position by -1/999, wrong outputs without an error."""
    rope_scaling, problem = INVALID_ROPE[name]
    llama = rope_warnings(reload_with(LlamaConfig, rope_scaling))
    assert len(llama) == 1 and problem in llama[0], f"LlamaConfig logged {llama}: transformers' validation changed"
    with pytest.raises(ValueError, match=rf"^DiffConfig: invalid rope_parameters .*{problem}.*; fix or remove them"):
        reload_with(DiffConfig, rope_scaling)()
    with pytest.raises(ValueError, match=problem):
        DiffConfig(rope_parameters=dict(rope_scaling), **SIZES)
    saved = {**DiffConfig(**SIZES).to_dict(), "rope_scaling": rope_scaling}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=problem):
        DiffConfig.from_pretrained(tmp_path)


def test_rope_validation_in_code():
    assert rope_warnings(reload_with(DiffConfig, {"rope_type": "linear", "factor": 10.0})) == []
    unknown_key = {"rope_type": "linear", "factor": 10.0, "foo": "bar"}  # ignored by both: a warning, as for Llama
    assert rope_warnings(reload_with(DiffConfig, unknown_key)) == rope_warnings(reload_with(LlamaConfig, unknown_key))
    assert len(rope_warnings(reload_with(DiffConfig, unknown_key))) == 1
    with pytest.raises(ValueError, match="Missing required keys.*'factor'"):  # LlamaConfig: KeyError
        DiffConfig(rope_parameters={"rope_type": "linear"}, **SIZES)
    scaled = DiffConfig(rope_parameters={"rope_type": "linear", "factor": 2.0}, **SIZES)
    assert scaled.rope_parameters["factor"] == 2.0


UNSUPPORTED = {  # name: (keywords / config.json keys, a fragment of the answer)
    "sliding-window": ({"sliding_window": 32}, "sliding_window=32 (the model attends to the whole context)"),
    "partial-rotary-rope-parameters": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        "rope_parameters.partial_rotary_factor=0.5 (the model rotates every dimension of a head)"),
    "partial-rotary-rope-scaling": ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}},
                                    "rope_scaling.partial_rotary_factor=0.25"),
    "partial-rotary-top-level": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
}


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_fields_refused(name, tmp_path):
    """transformers' DIFF model ignores these and vLLM applies them (different tokens from the first one): refused
    in code and in a saved config.json, naming the field and the fix."""
    fields, fragment = UNSUPPORTED[name]
    assert any(fragment in found for found in configuration_diff.unsupported_fields(fields)), fields
    with pytest.raises(ValueError, match=rf"^DiffConfig: {re.escape(fragment)}.* is not supported; remove it\.$"):
        DiffConfig(**SIZES, **json.loads(json.dumps(fields)))
    (tmp_path / "config.json").write_text(json.dumps({**DiffConfig(**SIZES).to_dict(), **fields}))
    with pytest.raises(ValueError, match=rf"{re.escape(fragment)}.* is not supported; remove it from config\.json"):
        DiffConfig.from_pretrained(tmp_path)


def test_supported_values_kept():
    assert configuration_diff.unsupported_fields({"sliding_window": None, "partial_rotary_factor": 1.0,
                                                  "rope_parameters": {"partial_rotary_factor": 1}}) == []
    both = configuration_diff.unsupported_fields({"sliding_window": 8, "rope_scaling": {"partial_rotary_factor": 0.5}})
    assert len(both) == 2, both
    with pytest.raises(ValueError, match="are not supported; remove them"):
        DiffConfig(**SIZES, sliding_window=8, partial_rotary_factor=0.5)
    assert DiffConfig(**SIZES, sliding_window=None).head_dim == 16


BAD_TYPES = {  # name: (field, value, the type the answer asks for)
    "str-for-int": ("num_hidden_layers", "two", "an int"),
    "null-for-int": ("num_hidden_layers", None, "an int"),
    "float-for-int": ("hidden_size", 64.0, "an int"),
    "bool-for-int": ("vocab_size", True, "an int"),
    "str-for-optional-int": ("num_key_value_heads", "2", "an int or None"),
    "nan-eps": ("rms_norm_eps", math.nan, "a finite float"),
    "inf-std": ("lambda_std_dev", math.inf, "a finite float"),
    "str-for-float": ("lambda_init", "0.5", "a finite float or None"),
    "int-for-bool": ("use_subln", 1, "a bool"),
    "str-for-list": ("attention_types", "standard", "a list of str or None"),
    "mixed-list": ("eos_token_id", [2, "</s>"], "an int or a list of int or None"),
}
BAD_RANGES = {  # name: (field, value, a fragment of the answer)
    "negative-size": ("intermediate_size", -128, "intermediate_size must be a positive integer, got -128"),
    "zero-kv-heads": ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
    "negative-context": ("max_position_embeddings", -1, "max_position_embeddings must be a positive integer, got -1"),
    "zero-eps": ("rms_norm_eps", 0.0, "rms_norm_eps must be > 0, got 0.0"),
    "negative-std": ("lambda_std_dev", -0.1, "lambda_std_dev is a standard deviation, so >= 0; got -0.1"),
}


def case(name: str) -> tuple[str, object, str, str | None]:
    """(field, value, a fragment of the answer, what the type answer asks for or None)."""
    if name in BAD_TYPES:
        field, value, expected = BAD_TYPES[name]
        return field, value, f"{field} must be {expected}, got {value!r} ({type(value).__name__})", expected
    return *BAD_RANGES[name], None


def assert_one_line(error: pytest.ExceptionInfo, fragment: str, ending: str) -> None:
    message = str(error.value)
    assert "\n" not in message, f"the answer spans lines: {message!r}"
    assert message.startswith("DiffConfig: ") and fragment in message, f"{fragment!r} not in {message!r}"
    assert message.endswith(ending), f"{message!r} does not end with the fix {ending!r}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    DiffConfig(**SIZES).save_pretrained(folder)
    return folder


def edited_copy(saved: Path, folder: Path, field: str, value: object) -> Path:
    """The saved folder with one value of config.json changed, as a user edits it (json writes NaN and Infinity)."""
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", [*BAD_TYPES, *BAD_RANGES])
def test_bad_field_in_code(name):
    field, value, fragment, expected = case(name)
    with pytest.raises(ValueError) as error:
        DiffConfig(**{**SIZES, field: value})
    assert_one_line(error, fragment, f"; pass {expected}." if expected else ".")


@pytest.mark.parametrize("name", [*BAD_TYPES, *BAD_RANGES])
def test_bad_field_in_config_json(saved, tmp_path, name):
    field, value, fragment, expected = case(name)
    folder = edited_copy(saved, tmp_path / "edited", field, value)
    for load in (AutoConfig.from_pretrained, DiffConfig.from_pretrained):
        with pytest.raises(ValueError) as error:
            load(folder)
        assert_one_line(error, fragment, "; fix it in config.json." if expected else ".")


def test_good_values_of_other_types_load(saved, tmp_path):
    """JSON has no float type of its own: an int in a float field is a float; null is the default where allowed."""
    folder = edited_copy(saved, tmp_path / "edited", "lambda_init", 0)
    assert DiffConfig.from_pretrained(folder).lambda_init == 0
    config = DiffConfig(**SIZES, rms_norm_eps=1, attention_dropout=0, eos_token_id=[2, 3], num_key_value_heads=None)
    assert (config.rms_norm_eps, config.eos_token_id, config.num_key_value_heads) == (1, [2, 3], 2)


@pytest.mark.parametrize(("typo", "field"), [("num_heads", "num_attention_heads"), ("num_layers", "num_hidden_layers"),
                                             ("lambda_std", "lambda_std_dev"), ("subln", "use_subln")])
def test_misspelt_config_field(typo, field):
    with pytest.raises(ValueError, match=f"unknown field '{typo}'; did you mean .*'{field}'"):
        DiffConfig(**{typo: 4})


def test_saved_config_with_extra_keys_reloads(tmp_path):
    """Keys other tools add to a saved config (transformers' tests add `batch_norm_eps`, close to `rms_norm_eps`) are
    kept as transformers keeps them: the typo check is for DiffConfig built in code."""
    config = DiffConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.batch_norm_eps = 1e-5
    config.save_pretrained(tmp_path)
    assert DiffConfig.from_pretrained(tmp_path).batch_norm_eps == 1e-5



def test_embedding_multiplier_defaults_to_sqrt_hidden_and_round_trips(tmp_path):
    """A new config scales embeddings by sqrt(hidden_size); an explicit value is kept; save and reload keep it and
    write it to config.json (so a folder means the same model wherever it is loaded)."""
    assert DiffConfig(hidden_size=64, num_attention_heads=2).embedding_multiplier == 8.0
    assert DiffConfig(hidden_size=96, num_attention_heads=2).embedding_multiplier == math.sqrt(96)
    config = tiny_config(embedding_multiplier=2.5)
    assert config.embedding_multiplier == 2.5
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["embedding_multiplier"] == 2.5
    assert AutoConfig.from_pretrained(tmp_path).embedding_multiplier == 2.5


def test_config_saved_before_the_multiplier_loads_unscaled(tmp_path):
    """A config.json without the field (every folder saved before it existed) keeps the 1.0 it was trained with,
    through AutoConfig and DiffConfig alike; a config built in code gets the new default."""
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["embedding_multiplier"] == math.sqrt(saved["hidden_size"])
    del saved["embedding_multiplier"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert AutoConfig.from_pretrained(tmp_path).embedding_multiplier == 1.0
    assert DiffConfig.from_pretrained(tmp_path).embedding_multiplier == 1.0
    assert DiffConfig.from_dict(saved).embedding_multiplier == 1.0


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), "2"])
def test_bad_embedding_multiplier_refused(value):
    with pytest.raises(ValueError, match="embedding_multiplier must be"):
        tiny_config(embedding_multiplier=value)


def test_misspelt_field_in_a_saved_config_refused(tmp_path):
    """`"num_heads": 8` written into a saved config.json was kept as an unused attribute (the model built with the
    saved num_attention_heads): refused in one line naming the nearest fields, as the constructor refuses it. Keys
    transformers writes and other models' norm epsilons still load."""
    tiny_config().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_heads": 8}))
    with pytest.raises(ValueError) as error:
        DiffConfig.from_pretrained(tmp_path)
    message = str(error.value)
    assert message.startswith("DiffConfig: unknown field 'num_heads' in config.json; did you mean ") and \
        "'num_attention_heads'?" in message and "\n" not in message, message
    assert message.endswith("(transformers would keep it as an unused attribute); fix or remove it."), message
    extras = {"layer_norm_eps": 1.0, "norm_epsilon": 1.0, "torch_dtype": "float32", "rope_scaling": None,
              "_name_or_path": "x", "base_model": "meta-llama/Llama-3.2-1B"}
    (tmp_path / "config.json").write_text(json.dumps({**config, **extras}))
    assert DiffConfig.from_pretrained(tmp_path).layer_norm_eps == 1.0


def test_committed_folders_still_load():
    """Every DIFF config.json committed in the repository (benchmark runs, fixtures) passes the saved-keys check."""
    root = Path(__file__).resolve().parents[1]
    found = [path for path in root.glob("**/config.json") if ".git" not in path.parts
             and json.loads(path.read_text()).get("model_type") == "diff_transformer"]
    assert found
    for path in found:
        DiffConfig.from_pretrained(path.parent)


@pytest.mark.parametrize("keyword", ["dtype", "torch_dtype"])
def test_dtype_names_a_torch_dtype(tmp_path, keyword):
    """`dtype="fp16"` failed inside transformers with `module 'torch' has no attribute 'fp16'`: one line naming the
    dtypes, in a config built in code and in `from_pretrained`'s keyword; a real name still works."""
    message = r"^DiffConfig: dtype 'fp16' is no torch dtype; use 'float16', 'bfloat16' or 'float32'"
    with pytest.raises(ValueError, match=message):
        tiny_config(**{keyword: "fp16"})
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        DiffConfig.from_pretrained(tmp_path, **{keyword: "fp16"})
    assert str(tiny_config(**{keyword: "bfloat16"}).dtype) == "torch.bfloat16"


def test_poly_norm_and_standard_layers_build_for_any_head_count():
    """The PolyNorm MLP and a hybrid stack's standard layers build Llama's modules from the DiffConfig's own sizes:
    a throwaway LlamaConfig (32 default heads, or h dv / d heads) refused hidden 48 ("not a multiple of the number
    of attention heads")."""
    import torch

    from diff_transformer import DiffForCausalLM
    from diff_transformer.poly_norm import PolyNorm

    config = DiffConfig(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=3, head_dim=8, value_head_dim=24, hidden_act="poly_norm",
                        attention_types=["differential", "standard"])
    model = DiffForCausalLM(config)
    standard = model.model.layers[1].self_attn
    assert isinstance(model.model.layers[0].mlp.act_fn, PolyNorm)
    assert (standard.q_proj.out_features, standard.o_proj.in_features) == (3 * 3 * 8, 3 * 3 * 8)
    assert torch.isfinite(model(torch.randint(0, 50, (1, 6))).logits).all()
