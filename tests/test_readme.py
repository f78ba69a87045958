"""Every code block of the README and of the docs pages runs as written, on its own.

Each block runs in its own process and its own working folder, as a reader who opens a page at that block would run
it: a Python block in a fresh interpreter, a bash block in a fresh shell. The folder holds what the pages say the
reader brings (PLACEHOLDERS: `my_corpus.txt`, `path/to/llama`, `out/my-model`, `out/llama-baseline`, and
`runs/my-model`, the folder the docs' `train` command writes) and the repository's `tests/`, `configs/` and
`examples/`, as in a clone; a block that loads what an earlier block on its page writes runs after that block (NEEDS).
Whatever a block writes must go under `runs/` (git-ignored), so the pages' snippets leave nothing in a clone's root.
The slow suite runs, per extra (EXTRAS), its first block once more in a fresh venv holding the package and only
that extra, and the README's main command in a fresh copy of the repository, as it says.
Each block needs an entry in BLOCKS, and each docs page an entry in PAGES, so a new or changed block cannot go
untested. Relative links between the pages must point at files that exist.
"""

import ast
import functools
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from diff_transformer import DiffConfig, DiffForCausalLM
from diff_transformer.tools.evaluation import CITIES, FILLER, needle
from diff_transformer.tokenization_diff import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# Reading order.
PAGES = ("README.md", "docs/backends.md", "docs/ecosystem.md", "docs/export.md", "docs/conversion.md",
         "docs/evaluation.md", "docs/troubleshooting.md", "docs/versions.md", "docs/serving.md", "docs/design.md",
         "docs/kernels.md", "docs/unilm.md", "docs/contributing.md")
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.DOTALL | re.MULTILINE)
SKIP = "skip: "
# A text that identifies each block -> how it is tested: "fast" (default run), "slow", "gpu", "isolated" (slow, in a
# fresh copy of the repository with its own venv), or "skip: why".
BLOCKS = {
    "python3 -m venv .venv": "isolated",
    "bash .ci/run": SKIP + "the test suite itself",
    "MultiheadDiffAttn(embed_dim=256": "fast",
    "back = unilm_to_diff(state": "fast",
    "curl -o tinyshakespeare.txt": SKIP + "downloads the corpus from the internet (the page gives its sha256)",
    "python benchmarks/paper_small.py --tasks text": SKIP + "the experiment itself (RESULTS.md has its run time); "
    "tests/test_evaluation.py runs its --quick mode",
    "config = DiffConfig(vocab_size=1000": "fast",
    "capture_branch_attentions(model) as branches": "fast",
    'pip install -e ".[triton]"': SKIP + "installs the GPU backends (CUDA)",
    "tokenizer = train_bpe_tokenizer(": "fast",
    'args = TrainingArguments("runs/trainer"': "slow",
    "diff-transformer train --data my_corpus.txt --output runs/my-model": "slow",
    "modules_to_save=DIFF_TRAINABLE_MODULES))": "slow",
    "GRPOTrainer(model=model, reward_funcs=reward_len": "slow",
    'generator = pipeline("text-generation", model="runs/my-model")': "slow",
    'AutoModelForTokenClassification.from_pretrained("runs/my-model"': "fast",
    "with init_empty_weights():": "slow",
    "torchrun --nproc_per_node 2 examples/ddp_train.py runs/ddp 2": "slow",
    "--config_file configs/accelerate_fsdp.yaml": "gpu",
    "# tp_generate.py": SKIP + "the script the next block launches (tests/test_tensor_parallel.py loads with "
    'tp_plan="auto" under torchrun)',
    "torchrun --nproc_per_node 4 tp_generate.py": "gpu",
    "torchrun --nproc_per_node 2 examples/fsdp_train.py runs/fsdp": "slow",
    "fully_shard(layer)": SKIP + "runs inside each torchrun process; examples/fsdp_train.py is this code",
    'dcp.load(state_dict, checkpoint_id="runs/fsdp/checkpoint", no_dist=True)': "slow",
    "configs/deepspeed_zero3.json  # CPU, gloo, via Trainer": SKIP + "needs deepspeed; tests/test_training.py runs the "
    "CPU line where it is installed",
    "diff-transformer upload runs/my-model my-user/diff-tiny --dry-run": "slow",
    'from_pretrained("my-user/diff-tiny", trust_remote_code=True)': SKIP + "downloads from the Hub (the same calls "
    "on a local folder run in tests/test_hub_upload.py)",
    "class Logits(torch.nn.Module):": "slow",
    "diff-transformer convert path/to/llama runs/diff-llama": "slow",
    "diff-transformer convert path/to/Motif-2.6B runs/motif-2.6b": SKIP + "needs a Motif-2 download; "
    "tests/test_motif.py converts folders in the publisher's format",
    'convert_checkpoint("path/to/llama", "runs/diff-llama")': "slow",
    "LambdaWarmupCallback(target=0.5, warmup_steps=1000)": "slow",
    "diff-transformer eval-needle out/my-model": "slow",
    "diff-transformer serve FOLDER --port 8000": SKIP + "needs vLLM's CUDA build and a GPU",
    "diff-transformer serve FOLDER --kv-cache-gib 1": SKIP + "needs vLLM's CPU build: tests/vllm_serving serves a "
    "trained folder this way (bash .ci/run vllm)",
    "diff-transformer serve FOLDER --tensor-parallel-size 2": SKIP + "needs vLLM's build and 2 cores or devices: "
    "tests/vllm_serving serves with 2 tensor- and 2 pipeline-parallel ranks (bash .ci/run vllm)",
    "diff-transformer serve FOLDER --host 0.0.0.0 --api-key-file": SKIP + "needs vLLM and serves until stopped; "
    "tests/vllm_serving/test_serving_checks.py checks the key reaches vLLM only through its environment",
    "diff-transformer attention-noise out/my-model": "slow",
    "--output docs/images/attention_noise": SKIP + "writes the committed example into docs/images; "
    "tests/test_plots.py runs this command's evaluation and checks it against the committed table",
    "results = model.generate_batch(": SKIP + "tests/test_continuous_batching.py makes these calls on tiny models",
    "python -m diff_transformer.serving.transformers_serve FOLDER": SKIP + "tests/test_transformers_serve.py starts "
    "this server on a saved folder",
}
# lines of a run block left out: an upload needs the network and a real token
LEFT_OUT = ("HF_TOKEN=hf_... diff-transformer upload",)
# block -> the earlier block that writes what it loads
NEEDS = {
    "capture_branch_attentions(model) as branches": "config = DiffConfig(vocab_size=1000",  # runs/my-diff
    'dcp.load(state_dict, checkpoint_id="runs/fsdp/checkpoint", no_dist=True)':
        "torchrun --nproc_per_node 2 examples/fsdp_train.py runs/fsdp",
    "LambdaWarmupCallback(target=0.5, warmup_steps=1000)": "diff-transformer convert path/to/llama runs/diff-llama",
}
# block -> the extra its page says to install for it (`pip install -e ".[extra]"`)
EXTRAS = {"modules_to_save=DIFF_TRAINABLE_MODULES))": "peft", "class Logits(torch.nn.Module):": "export"}
# placeholder folder -> the block that writes it itself (it runs without the placeholder)
WRITTEN_BY = {"runs/my-model": "diff-transformer train --data my_corpus.txt --output runs/my-model"}


@dataclass
class Block:
    index: int
    page: str
    language: str
    code: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.index:02d}-{Path(self.page).stem}-{self.language}-{self.code.splitlines()[0][:40]}"


def readme_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        for match in FENCE.finditer((ROOT / page).read_text(encoding="utf-8")):
            language, code = match.groups()
            modes = [mode for key, mode in BLOCKS.items() if key in code]
            mode = modes[0] if len(modes) == 1 else f"unmapped ({len(modes)} keys)"
            blocks.append(Block(len(blocks), page, language, code, mode))
    return blocks


def marks(mode: str) -> list:
    if mode == "gpu":
        return [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    return [pytest.mark.slow] if mode in ("slow", "isolated") else []


DOC_BLOCKS = readme_blocks()


def corpus(path: Path) -> None:
    """A small English-like text: filler sentences, needles and two speakers."""
    rng = random.Random(0)
    lines = []
    for _ in range(1500):
        speaker = rng.choice(["ROMEO:", "JULIET:"])
        lines.append(f"{speaker} {rng.choice(FILLER)} {needle(rng.choice(CITIES), str(rng.randrange(1000, 9999)))}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def save_llama(path: Path, tokenizer, layers: int) -> None:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def save_diff(path: Path, tokenizer) -> None:
    config = DiffConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, max_position_embeddings=256)  # the context `train --data` gives
    DiffForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


PLACEHOLDERS = ("my_corpus.txt", "path/to/llama", "out/llama-baseline", "out/my-model", "runs/my-model")
REPOSITORY = ("tests", "configs", "examples")  # the repository files the pages' commands name


def make_placeholders(folder: Path) -> None:
    """What the pages assume the reader has (PLACEHOLDERS), and links to REPOSITORY."""
    for name in REPOSITORY:
        (folder / name).symlink_to(ROOT / name)
    corpus(folder / "my_corpus.txt")
    torch.manual_seed(0)
    tokenizer = train_bpe_tokenizer(files=[folder / "my_corpus.txt"], vocab_size=400)
    save_llama(folder / "path" / "to" / "llama", tokenizer, layers=32)  # `--layers 1-31` needs 32
    save_llama(folder / "out" / "llama-baseline", tokenizer, layers=2)
    save_diff(folder / "out" / "my-model", tokenizer)
    save_diff(folder / "runs" / "my-model", tokenizer)


def block_with(key: str) -> Block:
    return next(b for b in DOC_BLOCKS if key in b.code)


def run_code(block: Block, folder: Path, python: Path | None = None) -> None:
    """The block in its own process, in `folder`: under this interpreter with the working tree importable, or under
    `python`, a venv's, with what is installed there and nothing else."""
    if python is None:
        python = Path(sys.executable)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env['PATH']}"
    if block.language == "python":
        script = folder.parent / f"block-{block.index:02d}.py"
        script.write_text(block.code)
        command = [str(python), str(script)]
    else:
        code = "\n".join(line for line in block.code.splitlines() if not line.startswith(LEFT_OUT))
        command = ["bash", "-euo", "pipefail", "-c", code]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"block {block.name} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"


def files_in(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*") if not path.is_dir()}


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("placeholders")
    make_placeholders(folder)
    return folder


def reader_folder(placeholders: Path, folder: Path, block: Block) -> Path:
    """A copy of the placeholders, less those `block` writes itself."""
    own = {path for path, key in WRITTEN_BY.items() if key in block.code}
    shutil.copytree(placeholders, folder, symlinks=True,
                    ignore=lambda parent, names: [n for n in names if str(Path(parent, n).relative_to(placeholders))
                                                  in own])
    return folder


def test_every_block_is_mapped():
    unmapped = [b.name for b in DOC_BLOCKS if b.mode not in ("fast", "slow", "gpu", "isolated")
                and not b.mode.startswith(SKIP)]
    assert not unmapped, f"blocks with no (or several) entries in BLOCKS: {unmapped}"
    keys = [*BLOCKS, *NEEDS, *NEEDS.values(), *WRITTEN_BY.values(), *EXTRAS]
    matches = {key: sum(key in b.code for b in DOC_BLOCKS) for key in keys}
    assert all(n == 1 for n in matches.values()), f"each key of the tables must match one block: {matches}"


def test_every_docs_page_is_read():
    pages = {f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md")}
    assert pages <= set(PAGES), f"docs pages missing from PAGES, so their blocks would not run: {pages - set(PAGES)}"
    missing = [page for page in PAGES if not (ROOT / page).is_file()]
    assert not missing, f"PAGES names pages that do not exist: {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (lower case, punctuation dropped, spaces as hyphens)."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall((ROOT / page).read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = ((ROOT / page).parent / file).resolve() if file else ROOT / page
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{page}: {target}")
    assert not broken, f"links to files or headings that do not exist: {broken}"


CITED = re.compile(r"`([^`\s]+)`")
# A cited name: a path (a / or a file suffix), a test node id (path::test), or a function or attribute written
# `name()` or `Owner.name`; other code spans (options, values, markers) are not names.
CITED_PATH = re.compile(r"^[\w.-]*(?:/[\w.-]*)+$|^[\w-]+\.(?:py|md|txt|json|toml)$")
CITED_NAME = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(\(\))?$")
# where a bare file name may live
NAME_HOMES = ("", "diff_transformer", "diff_transformer/tools", "diff_transformer/serving", "tests", ".ci")
# pages whose every cited path, test and function must exist (the maintainer's page, the versions page's table)
CITING_PAGES = ("docs/contributing.md", "docs/versions.md")


@functools.cache
def project_definitions() -> frozenset[str]:
    """Every name the project's Python files define: functions, classes, and assigned names (also in classes)."""
    names = set()
    for path in [*ROOT.glob("*.py"), *(ROOT / "diff_transformer").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def missing_citation(token: str) -> str | None:
    """Why `token`, cited in a docs page, names nothing in the project (None: it exists, or is not a name)."""
    path, _, test = token.partition("::")
    if test:
        file = ROOT / path
        if not file.is_file() or not re.search(rf"^\s*def {re.escape(test)}\(", file.read_text(), re.MULTILINE):
            return f"no test {test} in {path}"
        return None
    if CITED_PATH.match(token):
        if any((ROOT / home / token.rstrip("/")).exists() for home in NAME_HOMES):
            return None
        return f"no file {token}"
    name = CITED_NAME.match(token)
    if name and (name[2] or "." in token) and name[1] not in project_definitions():
        return f"nothing defines {name[1]}"
    return None


@pytest.mark.parametrize("page", CITING_PAGES)
def test_cited_files_tests_and_functions_exist(page):
    text = FENCE.sub("", (ROOT / page).read_text(encoding="utf-8"))
    cited = [token for token in CITED.findall(text) if "::" in token or page == "docs/contributing.md"]
    missing = [f"`{token}`: {why}" for token in cited if (why := missing_citation(token))]
    assert not missing, f"{page} cites what does not exist: {missing}"


def test_citation_check_sees_what_is_missing():
    assert missing_citation("tests/test_layers.py::test_no_upward_imports") is None
    assert missing_citation("tests/test_layers.py::test_gone") == "no test test_gone in tests/test_layers.py"
    assert missing_citation("attention_kernels.py") is None and missing_citation("gone.py") == "no file gone.py"
    assert missing_citation("select_kernel()") is None and missing_citation("DiffConfig.layer_cache()") is None
    assert missing_citation("gone_function()") == "nothing defines gone_function"
    assert missing_citation("--dist") is None  # not a name


def test_blocks_that_cannot_run_here_say_why_and_where_they_are_covered():
    """Blocks mapped "skip: why" (a GPU build, a download, the suite itself) are not run, so not collected as
    tests; each names its reason."""
    reasons = {b.name: b.mode.removeprefix(SKIP) for b in DOC_BLOCKS if b.mode.startswith(SKIP)}
    assert all(len(reason) > 10 for reason in reasons.values()), reasons


@pytest.mark.parametrize("block", [pytest.param(b, marks=marks(b.mode), id=b.name)
                                   for b in DOC_BLOCKS if b.mode != "isolated" and not b.mode.startswith(SKIP)])
def test_readme_block_runs(placeholders, tmp_path, block):
    run_alone(block, reader_folder(placeholders, tmp_path / "reader", block))


def run_alone(block: Block, folder: Path, python: Path | None = None) -> None:
    """`block` after the blocks it NEEDS, in `folder`; it may write only under runs/."""
    for key, earlier in NEEDS.items():
        if key in block.code:
            run_code(block_with(earlier), folder, python)
    before = files_in(folder)
    run_code(block, folder, python)
    outside = sorted(str(path) for path in files_in(folder) - before if path.parts[0] != "runs")
    assert not outside, f"block {block.name} wrote {outside}: write under runs/ (git-ignored) instead"


@pytest.fixture(scope="module")
def fresh_venvs(tmp_path_factory) -> Callable[[str], Path]:
    """extra ("" for none) -> the python of a fresh venv with `pip install -e ".[extra]"` alone, made on first use."""
    pythons = {}

    def python(extra: str) -> Path:
        if extra not in pythons:
            venv = tmp_path_factory.mktemp(f"venv-{extra or 'base'}")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            target = f"{ROOT}[{extra}]" if extra else str(ROOT)
            # torch first, as the README's main command installs it: the CPU build where the machine keeps one
            for args in (["torch==2.13.0"], ["-e", target]):
                subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args], check=True,
                               capture_output=True, timeout=1800)
            pythons[extra] = venv / "bin" / "python"
        return pythons[extra]

    return python


def extra_of(block: Block) -> str:
    return next((extra for key, extra in EXTRAS.items() if key in block.code), "")


def first_block_per_extra() -> list[Block]:
    """Per extra ("" for none), the first runnable block that needs it: a venv install costs minutes, and every block
    also runs in the default suite, so one block per install is what checks that the extra is enough."""
    chosen = {}
    for block in DOC_BLOCKS:
        if block.mode in ("fast", "slow"):
            chosen.setdefault(extra_of(block), block)
    return list(chosen.values())


@pytest.mark.slow
@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in first_block_per_extra()])
def test_readme_block_in_fresh_venv(placeholders, fresh_venvs, tmp_path, block):
    """As a reader who installs only what the page names (EXTRAS) runs it."""
    run_alone(block, reader_folder(placeholders, tmp_path / "reader", block), fresh_venvs(extra_of(block)))


def repository_copy(folder: Path) -> Path:
    """The repository's tracked files, as a fresh clone has them."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, folder / name)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in DOC_BLOCKS if b.mode == "isolated"], ids=lambda b: b.name)
def test_readme_main_command_on_a_fresh_copy(tmp_path, block):
    """The README's main job in a fresh venv (pip install from the package index), as it claims."""
    clone = repository_copy(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(sys.executable).parent != Path(p))
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=3600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    accuracy = float(re.search(r"retrieval accuracy on held-out prompts: ([\d.]+)", output).group(1))
    assert accuracy >= 0.95, f"held-out retrieval accuracy {accuracy} (RESULTS.md: 1.000 with the default seed)"
    assert "generated: k3 v7 k9 v2 ? k9 v2" in result.stdout, result.stdout[-2000:]


TRACKER_WORDS = re.compile(r"\bissue #\d+|\b(?:machines|GPUs) we use\b", re.IGNORECASE)


def test_project_text_speaks_of_the_project():
    """No tracker numbers or "we use" in what the repository shows (HISTORY.md records history and may)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    found = [f"{name}:{number}: {line.strip()}" for name in listed
             if name.endswith((".py", ".md", ".txt", ".ipynb", ".toml", ".cfg")) and not name.endswith("HISTORY.md")
             for number, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
             if TRACKER_WORDS.search(line) and name != "tests/test_readme.py"]
    assert not found, "\n".join(found)
