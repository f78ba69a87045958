"""Bad values in a config answer in one line naming the field (issue #33): wrong types and sizes, given in code or in
an edited config.json, raise ValueError before anything is built, not a TypeError from deep inside."""

import json
import math
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from diff_transformer import DiffConfig

SIZES = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)

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
