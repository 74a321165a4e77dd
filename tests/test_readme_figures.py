"""The README's "where it stands" figures come from results files: the block is exactly what
bench/readme_figures.py computes from the files it names, and each item names an existing results file under
docs/benchmarks/ and the command that made it. A figure edited by hand, or a results file replaced without the
block rewritten (`python -m triforce.bench.readme_figures --write`), fails here."""
import re
from pathlib import Path

import pytest

from triforce.bench import readme_figures as rf

REPO = Path(__file__).resolve().parents[1]  # this checkout's README and results, wherever the package is installed
README = REPO / "README.md"


@pytest.fixture(autouse=True)
def _this_checkout(monkeypatch):
    monkeypatch.setattr(rf, "ROOT", REPO)


def test_the_readme_block_is_what_its_results_files_give():
    assert rf.readme_block(README.read_text()) == rf.block()


def test_every_item_names_its_machine_command_and_results_file():
    items = [line for line in rf.block().splitlines() if line.startswith("- ")]
    assert len(items) == len(rf.ITEMS)
    for item in items:
        files = re.findall(r"\]\((docs/benchmarks/[^)]+)\)$", item)
        assert len(files) == 1 and (rf.ROOT / files[0]).is_file(), item
        commands = list(re.finditer(r" `(triforce |PYTHONPATH=src python benchmarks/)", item))  # user or lab command
        assert commands and any(machine in item for machine in rf.MACHINES), item
        figures = re.findall(r"\d+\.\d+", item[:commands[-1].start()])
        assert figures, item  # an item states figures, all before its command and file


def test_the_figures_follow_the_file(tmp_path, monkeypatch):
    """A changed results file changes the block: the figures are read, not written in."""
    import json
    import shutil

    rel = "docs/benchmarks/2026-11-26-zen5-three-prompts-32k/results.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    shutil.copy(REPO / rel, tmp_path / rel)
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    before = rf.three_prompts(rel)
    data = json.loads((tmp_path / rel).read_text())
    for r in data["runs"]:
        if r["method"] == "triforce" and r["temperature"] == 0.0:
            r["speedup_vs_ar"] = 9.99
    (tmp_path / rel).write_text(json.dumps(data))
    after = rf.three_prompts(rel)
    assert before != after and "9.99x (median 9.99x)" in after
