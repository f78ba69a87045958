"""DiffConfig as other tools handle it (issue #33): pickled by value as vLLM ships remote-code configs to its workers,
and checked by transformers' own rope validation as LlamaConfig is."""

import logging
import pickle
import subprocess
import sys
import types
from collections.abc import Callable

import pytest
from helpers import tiny_config
from transformers import LlamaConfig

from diff_transformer import DiffConfig
from diff_transformer import configuration_diff

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
    cloudpickle = pytest.importorskip("cloudpickle")
    cloudpickle.register_pickle_by_value(configuration_diff)
    try:
        blob = cloudpickle.dumps((DiffConfig, tiny_config(lambda_init=0.3)))
    finally:
        cloudpickle.unregister_pickle_by_value(configuration_diff)
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


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "linear", "factor": -999.0},
                                          {"type": "dynamic", "factor": 0.5},
                                          {"rope_type": "linear", "factor": 10.0, "foo": "bar"}])
def test_rope_validation_warns_as_for_llama(rope_scaling):
    llama = rope_warnings(reload_with(LlamaConfig, rope_scaling))
    assert len(llama) == 1, f"LlamaConfig logged {llama}: transformers' validation changed, revisit this test"
    diff = rope_warnings(reload_with(DiffConfig, rope_scaling))
    assert diff == llama, f"DiffConfig's rope parameters are not validated as Llama's: {diff} against {llama}"


def test_rope_validation_in_code():
    bad = {"rope_parameters": {"rope_type": "linear", "factor": -999.0}, **SIZES}
    llama = rope_warnings(lambda: LlamaConfig(**bad))
    assert len(llama) == 1 and "factor field" in llama[0], llama
    assert rope_warnings(lambda: DiffConfig(**bad)) == llama
    assert rope_warnings(reload_with(DiffConfig, {"rope_type": "linear", "factor": 10.0})) == []
    with pytest.raises(KeyError, match="factor"):  # as LlamaConfig: a rope type without its required key
        DiffConfig(rope_parameters={"rope_type": "linear"}, **SIZES)
