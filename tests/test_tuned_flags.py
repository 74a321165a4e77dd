"""This machine's tuned flags (tuning/flags.py): recorded by `triforce tune`, found by generate and bench
for the nearest context and temperature, ignored (with a message) when they describe another machine or
another version of the code, and never where the user set the flags."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from triforce.speculation.settings import SpecConfig
from triforce.tuning import flags


@pytest.fixture
def loaded(tiny_llama, tmp_path, monkeypatch):
    """A loaded-model stand-in (a tiny model and a model file) with its own tuned-flags file."""
    monkeypatch.setenv(flags.FILE_ENV, str(tmp_path / "tuned.json"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" * 4)
    return SimpleNamespace(model=tiny_llama, source=str(f), gguf_path=f, directory=tmp_path, weights="native",
                           cache_dir=None)


def chain(budget=512, gamma=5, gamma_draft=2):
    return {"budget": budget, "gamma": gamma, "gamma_draft": gamma_draft}


def entries(tmp_path):
    return json.loads((tmp_path / "tuned.json").read_text())["entries"]


def test_nearest_context_and_temperature_class(loaded, tmp_path):
    flags.record(loaded, "chain", 8000, 0.0, chain(512), {})
    flags.record(loaded, "chain", 32000, 0.0, chain(4096), {})
    flags.record(loaded, "chain", 32000, 0.6, chain(2048), {})
    budget = lambda n, t: (e := flags.lookup(loaded, "chain", n, t)) and e["flags"]["budget"]  # noqa: E731
    assert budget(9000, 0.0) == 512 and budget(20000, 0.0) == 4096 and budget(30000, 1.0) == 2048
    assert budget(8000, 0.6) is None  # sampled: no sampled entry within 2x of 8000
    assert budget(3000, 0.0) is None  # greedy: too far from 8000
    assert flags.lookup(loaded, "tree", 8000, 0.0) is None
    flags.record(loaded, "chain", 8000, 0.0, chain(1024), {"predicted_ms_per_token": 9.5})  # replaces
    assert len(entries(tmp_path)) == 3 and budget(8000, 0.0) == 1024
    assert flags.describe(flags.lookup(loaded, "chain", 8000, 0.0)).startswith(
        "--budget 1024 --gamma 5 --gamma-draft 2 (tuned at context 8000, T=0")


def test_another_machine_or_version_is_ignored_with_a_message(loaded, tmp_path):
    flags.record(loaded, "chain", 8000, 0.0, chain(), {})
    data = json.loads((tmp_path / "tuned.json").read_text())
    data["entries"][0]["identity"]["machine"] = "Some Other CPU, avx2 kernels, 2 threads"
    (tmp_path / "tuned.json").write_text(json.dumps(data))
    said = []
    assert flags.lookup(loaded, "chain", 8000, 0.0, said.append) is None
    assert len(said) == 1 and "measured on Some Other CPU, avx2 kernels, 2 threads, and this run is on" in said[0]
    assert "triforce tune" in said[0]
    data["entries"][0]["identity"]["machine"] = flags.machine_id(loaded.model)
    data["entries"][0]["identity"]["code"] = "0" * 12  # tuned with other code: its costs are stale
    (tmp_path / "tuned.json").write_text(json.dumps(data))
    said.clear()
    assert flags.lookup(loaded, "chain", 8000, 0.0, said.append) is None
    assert len(said) == 1 and "another version of triforce" in said[0]
    data["entries"][0]["identity"]["code"] = flags.code_version()
    (tmp_path / "tuned.json").write_text(json.dumps(data))
    assert flags.lookup(loaded, "chain", 8000, 0.0, said.append)["flags"] == chain()
    loaded.gguf_path.write_bytes(b"GGUF" * 5)  # another file at that path: another model, nothing to say
    said.clear()
    assert flags.lookup(loaded, "chain", 8000, 0.0, said.append) is None and not said


def test_an_unreadable_file_is_no_entries_and_the_next_record_replaces_it(loaded, tmp_path):
    (tmp_path / "tuned.json").write_text("{not json")
    assert flags.lookup(loaded, "chain", 8000, 0.0) is None
    flags.record(loaded, "chain", 8000, 0.0, chain(), {})
    assert len(entries(tmp_path)) == 1 and not list(tmp_path.glob(".tmp-*"))


def test_tuned_run_gives_the_named_methods_their_flags(loaded):
    flags.record(loaded, "chain", 8000, 0.0, chain(512, 5, 2), {})
    flags.record(loaded, "tree", 8000, 0.6, {"tree": "3,1"}, {})
    stack, cfg, entry = flags.tuned_run(loaded, "triforce", SpecConfig(draft="streaming"), 8000, 0.0)
    assert (cfg.budget, cfg.gamma, cfg.gamma_draft, cfg.draft) == (512, 5, 2, "streaming")
    assert stack.levels_text == "streaming,retrieval,full" and tuple(stack.gammas) == (2, 5)
    stack, cfg, entry = flags.tuned_run(loaded, "sequoia", SpecConfig(), 8000, 0.6)
    assert stack.levels_text == "streaming,full" and stack.tree_nodes == 6 and cfg == SpecConfig()
    assert flags.tuned_run(loaded, "sequoia", SpecConfig(), 8000, 0.0) is None  # the tree was tuned sampled
    assert flags.tuned_run(loaded, "ngram", SpecConfig(), 8000, 0.0) is None  # nothing tuned for it


def test_flags_the_user_set_win():
    from triforce.cli import build_parser
    from triforce.tuning.flags import tuned_allowed

    parse = lambda *a: build_parser().parse_args(["generate", "--prompt", "x", *a])  # noqa: E731
    assert tuned_allowed(parse(), "triforce") and tuned_allowed(parse(), "sequoia")
    for given in (["--gamma", "3"], ["--budget", "512"], ["--gamma-draft", "2"], ["--no-tuned"],
                  ["--levels", "ngram,full"], ["--gammas", "2,3"]):
        assert not tuned_allowed(parse(*given), "triforce"), given
    assert not tuned_allowed(parse("--tree", "2,1"), "sequoia") and tuned_allowed(parse("--gamma", "3"), "sequoia")
    assert not tuned_allowed(parse(), "ngram")
    args = parse()
    from triforce.commands.common import spec_config_from_args

    assert spec_config_from_args(args)[0] == SpecConfig(draft_kv_dtype=spec_config_from_args(args)[0].draft_kv_dtype)
