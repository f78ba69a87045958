"""The numbers README.md and docs/evaluation.md quote come from the stored results (benchmarks/summaries.py): a
quoted number that disagrees with them, or a stored run left out, fails here."""

import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = re.compile(r"(?P<task>text-long|text|retrieval)-(?P<model>DIFF|DiffLlama|Transformer)-seed(?P<seed>\d+)-")


def load_summaries():
    return load_benchmark("summaries")


@pytest.fixture(scope="module")
def summaries():
    return load_summaries()


def copy_tree(tmp_path: Path) -> Path:
    """The documents and the stored results, in a scratch root the test may change."""
    paper_small = ROOT / "benchmarks" / "paper_small"
    stored = [*paper_small.glob("*/results.json"), *paper_small.glob("study/*/results.json"),
              ROOT / "benchmarks" / "lm_scaling.py",
              ROOT / "benchmarks" / "lm_scaling" / "results.json"]
    for document in ("README.md", "docs/evaluation.md", "benchmarks/RESULTS.md"):
        (tmp_path / document).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / document, tmp_path / document)
    for results in stored:
        target = tmp_path / results.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(results, target)
    return tmp_path


def test_quoted_numbers_are_the_stored_results(summaries):
    assert summaries.stale(ROOT) == [], "run: python benchmarks/summaries.py"
    texts = {d: (ROOT / d).read_text() for d in summaries.DOCUMENTS}
    used = {m["name"] for text in texts.values() for m in summaries.BLOCK.finditer(text)}
    assert used == set(summaries.SECTIONS), f"sections without a block, or blocks without a section: {used}"
    assert "<!-- generated: paper-small-figures -->" in texts["docs/evaluation.md"]
    in_readme = {m["name"] for m in summaries.BLOCK.finditer(texts["README.md"])}
    assert in_readme == {"readme-summary"}, f"the README quotes the summary; the full tables live in docs: {in_readme}"


def test_a_number_that_disagrees_is_caught(summaries, tmp_path):
    """A number changed in a document, or a stored result changed under it, makes --check fail and names the block;
    rendering puts the stored number back."""
    root = copy_tree(tmp_path)
    assert summaries.main(["--check", "--root", str(root)]) == 0
    page = root / "docs" / "evaluation.md"
    original = page.read_text()
    long_runs = json.loads((root / "benchmarks" / "paper_small" / "text" / "results.json").read_text())["rows"]
    final = {row["model"]: row["val_loss"] for row in long_runs if row["task"] == "text-long"}
    quoted = "| " + " | ".join(f"{final[model]:.3f}" for model in ("DIFF", "DiffLlama", "Transformer")) + " |"
    assert original.count(quoted) == 1, f"the 3,200-step run's final losses are quoted: {quoted}"
    changed = quoted.replace(f"{final['Transformer']:.3f} |", f"{final['Transformer'] + 0.001:.3f} |")
    page.write_text(original.replace(quoted, changed))
    assert summaries.stale(root) == ["docs/evaluation.md: paper-small-figures"]
    assert summaries.main(["--check", "--root", str(root)]) == 1
    summaries.main(["--root", str(root)])
    assert page.read_text() == original

    results = root / "benchmarks" / "paper_small" / "retrieval" / "results.json"
    stored = json.loads(results.read_text())
    stored["rows"][0]["accuracy"] += 0.01
    results.write_text(json.dumps(stored))
    assert summaries.stale(root) == ["README.md: readme-summary", "docs/evaluation.md: paper-small-figures",
                                     "docs/evaluation.md: paper-small-retrieval"]


def test_the_study_long_run_is_quoted_from_its_rows():
    """docs/evaluation.md's study block quotes the long run's end and lowest losses and its passes over the data,
    recomputed here from the study's results.json."""
    found = json.loads((ROOT / "benchmarks" / "paper_small" / "study" / "text" / "results.json").read_text())
    long = {r["model"]: r for r in found["rows"] if r["task"] == "text-long"}
    if not long:
        pytest.skip("the study has no long run")
    page = (ROOT / "docs" / "evaluation.md").read_text()
    names = {"DIFF": "DIFF", "DiffLlama": "DiffLlama", "Transformer": "Llama"}
    end = ", ".join(f"{names[m]} {long[m]['val_loss']:.3f}" for m in names)
    lowest = ", ".join(f"{names[m]} {min(p['val_loss'] for p in long[m]['curve']):.3f}" for m in names)
    steps = long["DIFF"]["steps"]
    assert f"({steps:,} steps, {steps * found['batch'] / found['train_sequences']:.1f} passes" in page
    assert f"validation loss at the end {end}; lowest along training {lowest}" in page


def test_every_stored_run_is_reported_and_summarised_with_its_seed(summaries):
    """Each stored run (runs/*.pt) is a row of its report's results.json, and each row is a line of the per-run
    tables in docs/evaluation.md and a seed of its table of every figure."""
    docs = (ROOT / "docs" / "evaluation.md").read_text()
    for task_folder in ("text", "retrieval"):
        folder = ROOT / "benchmarks" / "paper_small" / task_folder
        rows = json.loads((folder / "results.json").read_text())["rows"]
        reported = sorted((r["task"], r["model"], r["seed"]) for r in rows)
        stored = sorted((m["task"], m["model"], int(m["seed"]))
                        for m in map(RUN_NAME.match, (p.name for p in (folder / "runs").glob("*.pt"))))
        assert stored == reported, f"{task_folder}: stored runs {stored} vs reported {reported}"
        for row in rows:
            line = f"| {row['model']} | {row['seed']} | {row['val_loss']:.3f} |"
            assert line in docs, f"docs/evaluation.md leaves out {row['task']} {row['model']} seed {row['seed']}"
            title = next(t for t, runs in summaries.experiments(ROOT) if row in runs)
            assert f"| {title} |" in docs and summaries.seeds([row]).split()[-1] in title, (
                f"docs/evaluation.md has no {row['task']} row for {title}")
            headline = row["accuracy"] if row["task"] == "retrieval" else row["val_loss"]
            assert f"{headline:.3f}" in docs, (
                f"docs/evaluation.md leaves out {row['task']} {row['model']} seed {row['seed']}")
