"""transformers' own common model tests (`ModelTesterMixin` of its tests/test_modeling_common.py) over DiffModel
and the four task heads, as transformers runs them for every model it ships.

transformers' test files are not part of its wheel, only of its source distribution: `bash .ci/run newest` downloads
the one of the installed release and points TRANSFORMERS_TESTS at its tests/ folder; without it this file is skipped.
By hand:

    pip download --no-deps --no-binary :all: transformers==$(python -c "import transformers as t; print(t.__version__)")
    tar xzf transformers-*.tar.gz && pip install parameterized
    TRANSFORMERS_TESTS=$PWD/transformers-<version>/tests python -m pytest -q tests/test_transformers_common.py

The source distribution lacks two modules test_modeling_common.py imports, the generation and export testers; they
stand in as empty mixins here. Generation has the project's own tests (test_generation.py), so
`all_generative_model_classes` is empty, as transformers asks of a tester without them; the generation tester's check
of the classes themselves, `test_inherits_generation_mixin`, runs here as written there.
"""

import os
import sys
import types
import unittest
from pathlib import Path

import pytest
import torch

from diff_transformer import (
    DiffConfig,
    DiffForCausalLM,
    DiffForQuestionAnswering,
    DiffForSequenceClassification,
    DiffForTokenClassification,
    DiffModel,
)

TESTS = os.environ.get("TRANSFORMERS_TESTS")
if not TESTS or not (Path(TESTS) / "test_modeling_common.py").is_file():
    pytest.skip("set TRANSFORMERS_TESTS to the tests/ folder of transformers' source distribution (see the module "
                "docstring)", allow_module_level=True)
pytest.importorskip("parameterized", reason="transformers' common tests need `pip install parameterized`")
# Some of the tests look for transformers' deprecation warnings, which pyproject.toml's filter would drop.
pytestmark = pytest.mark.filterwarnings("always::FutureWarning", "always::DeprecationWarning")


def import_transformers_tests(folder: str, name: str = "transformers_tests") -> str:
    """Import `folder` as package `name`, with empty stand-ins for the modules its source distribution lacks."""
    package = types.ModuleType(name)
    package.__path__ = [folder]
    sys.modules[name] = package
    stand_ins = {"exporters.test_export": "ExportTesterMixin", "generation.test_utils": "GenerationTesterMixin"}
    for module_name, class_name in stand_ins.items():
        parent, _, _ = module_name.partition(".")
        sys.modules.setdefault(f"{name}.{parent}", types.ModuleType(f"{name}.{parent}"))
        module = types.ModuleType(f"{name}.{module_name}")
        setattr(module, class_name, type(class_name, (), {}))
        sys.modules[f"{name}.{module_name}"] = module
    return name


common = __import__(f"{import_transformers_tests(TESTS)}.test_modeling_common", fromlist=["ModelTesterMixin"])
# The mixin skips the training tests of base models (no loss) by transformers' table of base model class names.
common.MODEL_MAPPING_NAMES = {**common.MODEL_MAPPING_NAMES, DiffConfig.model_type: DiffModel.__name__}


class DiffModelTester:
    """Tiny config and inputs, under the attribute names the mixin reads."""

    def __init__(self, parent, batch_size=2, seq_length=7, vocab_size=99, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, intermediate_size=37, num_labels=3):
        self.parent, self.is_training = parent, True
        self.batch_size, self.seq_length = batch_size, seq_length
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads, self.intermediate_size, self.num_labels = (
            num_key_value_heads, intermediate_size, num_labels)

    def get_config(self) -> DiffConfig:
        return DiffConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=64, num_labels=self.num_labels,
            pad_token_id=0,
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[DiffConfig, dict]:
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(min=1)  # no pads
        attention_mask = torch.tril(torch.ones_like(input_ids))  # left-aligned rows of lengths 1 and 2
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class DiffModelTest(common.ModelTesterMixin, unittest.TestCase):
    all_model_classes = (DiffModel, DiffForCausalLM, DiffForSequenceClassification, DiffForTokenClassification,
                         DiffForQuestionAnswering)
    all_generative_model_classes = ()  # the generation tester is not in the source distribution (docstring)

    def setUp(self):
        self.model_tester = DiffModelTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """The mixin picks labels by transformers' tables of class names, which do not hold ours: the same labels,
        picked by our classes."""
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=False)
        if return_labels:
            batch, length = self.model_tester.batch_size, self.model_tester.seq_length
            if model_class is DiffForQuestionAnswering:
                inputs_dict["start_positions"] = torch.zeros(batch, dtype=torch.long)
                inputs_dict["end_positions"] = torch.zeros(batch, dtype=torch.long)
            elif model_class is DiffForSequenceClassification:
                inputs_dict["labels"] = torch.zeros(batch, dtype=torch.long)
            elif model_class in (DiffForTokenClassification, DiffForCausalLM):
                inputs_dict["labels"] = torch.zeros(batch, length, dtype=torch.long)
        return inputs_dict

    def test_inherits_generation_mixin(self):
        """The generation tester's test of this name (tests/generation/test_utils.py, not in the source distribution),
        as written there, over the classes that generate: each names `GenerationMixin` among its direct bases."""
        generative = [model_class for model_class in self.all_model_classes if model_class.can_generate()]
        self.assertEqual(generative, [DiffForCausalLM])
        for model_class in generative:
            self.assertTrue("GenerationMixin" in str(model_class.__bases__))
