"""The package's entries in other libraries' tables: made by importing it, the same again after a second
registration, and all made in one module (`diff_transformer/registration.py`), which lists the two made elsewhere.
A saved folder's own code makes them without the package (tests/test_modeling.py, the remote-code test)."""

import ast
import re
from pathlib import Path

import peft.peft_model as peft_model
import transformers
from peft.utils import constants
from transformers import AutoConfig
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import diff_transformer
from diff_transformer import DiffConfig, modeling_diff, registration
from diff_transformer.attention_kernels import diff_flash_standard_attention
from diff_transformer.diff_tensor_parallel import DiffColwiseParallel, DiffReplicatedParallel
from diff_transformer.folder_defaults import AUTO_MODEL_CLASSES
from diff_transformer.peft_defaults import LORA_TARGET_MODULES, prefix_cache

PACKAGE = Path(diff_transformer.__file__).parent
REGISTERING = {"register", "register_model", "register_for_auto_class"}  # methods that add to another library's table
# the package's functions that fill tables: registration.py's, and peft_defaults.py's, which registration.py calls
REGISTRATION_FUNCTIONS = {*registration.__all__, "register_peft_defaults"}


def table_entries() -> dict[str, object]:
    """Our entry in each table that `registration.register` fills, by a name for the table."""
    lora = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    entries = {
        "attention": ALL_ATTENTION_FUNCTIONS["diff_flash"],
        "mask": ALL_MASK_ATTENTION_FUNCTIONS["diff_flash"],
        "diff_colwise": ALL_PARALLEL_STYLES["diff_colwise"],
        "diff_replicated": ALL_PARALLEL_STYLES["diff_replicated"],
        "AutoConfig": transformers.CONFIG_MAPPING["diff_transformer"],
        "lora": lora["diff_transformer"],
        "prefix": constants.TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING["diff_transformer"],
        "prepare_prompt_learning_config": peft_model._prepare_prompt_learning_config,
        "prepare_inputs": peft_model.PeftModelForCausalLM.prepare_inputs_for_generation,
    }
    for auto_name, class_name in AUTO_MODEL_CLASSES.items():
        entries[auto_name] = getattr(transformers, auto_name)._model_mapping[DiffConfig]
    return entries


def test_importing_the_package_fills_every_table():
    entries = table_entries()
    assert entries["attention"] is diff_flash_standard_attention and entries["mask"] is sdpa_mask
    assert type(entries["diff_colwise"]) is DiffColwiseParallel, entries["diff_colwise"]
    assert type(entries["diff_replicated"]) is DiffReplicatedParallel, entries["diff_replicated"]
    assert entries["AutoConfig"] is DiffConfig and DiffConfig._auto_class == "AutoConfig"
    for auto_name, class_name in AUTO_MODEL_CLASSES.items():
        model_class = getattr(modeling_diff, class_name)
        assert entries[auto_name] is model_class and model_class._auto_class == auto_name, auto_name
    assert entries["lora"] == LORA_TARGET_MODULES and entries["prefix"] is prefix_cache
    assert entries["prepare_prompt_learning_config"].diff_prefix_geometry
    assert entries["prepare_inputs"].diff_prefix_handover
    assert type(AutoConfig.for_model("diff_transformer")) is DiffConfig


def test_registering_again_changes_nothing():
    """A second `register` leaves every entry the same object (or an equal list); peft's wrapped functions are not
    wrapped twice."""
    before = table_entries()
    models = {auto_name: getattr(modeling_diff, name) for auto_name, name in AUTO_MODEL_CLASSES.items()}
    registration.register(DiffConfig, models)
    after = table_entries()
    changed = sorted(name for name in before if not (after[name] is before[name] or after[name] == before[name]))
    assert not changed, f"entries replaced by a second registration: {changed}"


def register_calls(path: Path) -> list[tuple[str, str]]:
    """(the enclosing top-level function or "<module>", the called name) for each call in `path` of a method that
    adds to a table (`REGISTERING`) or of a registration function (`REGISTRATION_FUNCTIONS`)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for top in tree.body:
        scope = top.name if isinstance(top, (ast.FunctionDef, ast.ClassDef)) else "<module>"
        for node in ast.walk(top):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in REGISTERING | REGISTRATION_FUNCTIONS:
                found.append((scope, name))
    return found


def test_registration_module_is_the_only_place_that_registers():
    """Outside registration.py (and serving/, vLLM's entry point), the package calls no method that adds to a
    table, and calls registration functions only at the places registration.py names: the model code's import,
    the task heads' constructor, the package's `__init__`."""
    calls = {path.relative_to(PACKAGE).as_posix(): register_calls(path) for path in sorted(PACKAGE.rglob("*.py"))
             if "serving" not in path.parts}
    own = calls.pop("registration.py")
    assert len([call for call in own if call[1] in REGISTERING]) >= 7, f"the parser missed calls: {own}"
    elsewhere = {(file, scope, name) for file, found in calls.items() for scope, name in found}
    allowed = {("modeling_diff.py", "<module>", "register_model_code"),
               ("modeling_diff.py", "DiffTaskHead", "register_backbone"),
               ("__init__.py", "<module>", "register")}
    assert elsewhere <= allowed, f"registrations outside registration.py: {sorted(elsewhere - allowed)}"
    text = (PACKAGE / "registration.py").read_text()
    for _, scope, name in elsewhere:
        assert scope in text or name in text, f"registration.py does not list {name} in {scope}"


def test_registration_lists_the_vllm_entry_point():
    setup = (PACKAGE.parent / "setup.py").read_text()
    entry = re.search(r'"vllm.general_plugins": \["diff_transformer = ([\w.:]+)"\]', setup)
    assert entry, "setup.py has no vllm.general_plugins entry point"
    assert entry[1] in (PACKAGE / "registration.py").read_text(), f"registration.py does not list {entry[1]}"
