"""The README's "where it stands" table comes from results files: the block is exactly what
bench/readme_figures.py computes from the files it names, and each row names its machine kind and an existing
results file under docs/benchmarks/ that records the command that made it. A figure edited by hand, or a results
file replaced without the block rewritten (`python -m triforce.bench.readme_figures --write`), fails here."""
import json
import re
import shutil
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


def test_the_table_is_in_the_readmes_first_screen():
    """What it is, install, run, test and the table: the README's first 60 lines."""
    lines = README.read_text().splitlines()
    assert rf.END in lines[:60]
    for needed in ("./install.sh && triforce generate", "./.ci/run", rf.BEGIN):
        assert any(needed in line for line in lines[:60]), needed


def test_every_row_names_its_machine_and_a_results_file_with_its_command():
    rows = [line for line in rf.block().splitlines() if line.startswith("| ")][1:]  # the header left out
    assert len(rows) == len(rf.ROWS) <= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 7, row
        assert any(cells[0].startswith(machine) for machine in rf.MACHINES), row
        assert re.search(r"\d+\.\d+x", cells[3]) and re.search(r"\d+\.\d+", cells[4]), row  # figures, read
        files = re.findall(r"\]\((docs/benchmarks/[^)]+)\)$", cells[6])
        assert len(files) == 1 and (rf.ROOT / files[0]).is_file(), row
        assert rf._command(json.loads((rf.ROOT / files[0]).read_text())["meta"]).startswith("triforce bench "), row


def test_the_figures_follow_the_file(tmp_path, monkeypatch):
    """A changed results file changes the row: the figures are read, not written in; a row without a time to
    first token in its file says '-'."""
    rel = "docs/benchmarks/2026-11-27-zen5-adaptive-32k/results.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    shutil.copy(REPO / rel, tmp_path / rel)
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    before = rf.adaptive(rel, 32000, rf.ZEN5)
    assert before[5] == "-"
    data = json.loads((tmp_path / rel).read_text())
    for r in data["runs"]:
        if "adaptive" in r and r["temperature"] == 0.0:
            r["speedup_vs_ar"] = 9.99
    (tmp_path / rel).write_text(json.dumps(data))
    after = rf.adaptive(rel, 32000, rf.ZEN5)
    assert before != after and after[3].startswith("9.99x / ")


def test_a_greedy_row_that_left_ars_tokens_stops_the_table(tmp_path, monkeypatch):
    rel = "docs/benchmarks/2026-11-27-zen5-adaptive-8k/results.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    data = json.loads((REPO / rel).read_text())
    next(r for r in data["runs"] if "adaptive" in r and r["temperature"] == 0.0)["lossless"] = False
    (tmp_path / rel).write_text(json.dumps(data))
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    with pytest.raises(ValueError, match="not equal to ar's"):
        rf.adaptive(rel, 8192, rf.ZEN5)


def test_a_row_s_time_to_first_token_is_its_file_s_prefills(tmp_path, monkeypatch):
    """A file that records each prompt's prefill (triforce bench's meta['prefills']) shows their span as the row's
    time to first token; changed in the file, it changes in the row."""
    rel = "docs/benchmarks/2026-11-30-zen5-adaptive-8k/results.json"
    (tmp_path / rel).parent.mkdir(parents=True)
    data = json.loads((REPO / rel).read_text())
    for p, s in zip(data["meta"]["prefills"], (1.3, 2.5, 2.0)):
        p["seconds"] = s
    (tmp_path / rel).write_text(json.dumps(data))
    monkeypatch.setattr(rf, "ROOT", tmp_path)
    assert rf.adaptive(rel, 8192, rf.ZEN5)[5] == "1.3-2.5 s (the prefill)"
