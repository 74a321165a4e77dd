"""The command line: JSON output, and clear errors (exit code 2, no traceback) for bad input."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import embedded_available

from triforce.speculation.settings import SpecConfig


def run(*args, input=None):
    return subprocess.run([sys.executable, "-m", "triforce", *args], capture_output=True, text=True,
                          input=input, timeout=600)


def test_help_explains_itself():
    r = run("generate", "--help")
    assert r.returncode == 0
    for flag in ("--prompt-file", "--model", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--json",
                 "--rope-theta", "--max-context", "--demo-tokens"):
        assert flag in r.stdout


def _assert_user_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_missing_model_file(tmp_path):
    _assert_user_error(run("generate", "--prompt", "hi", "--model", str(tmp_path / "nope.gguf")), "model not found")


def test_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 10)
    _assert_user_error(run("generate", "--prompt", "hi", "--model", str(f)), "not a .gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF garbage")
    _assert_user_error(run("generate", "--prompt", "hi", "--model", str(bad), "--cache-dir", str(tmp_path / "c")),
                       "cannot read GGUF")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    _assert_user_error(run("generate", "--prompt", "hi", "--model", str(tmp_path)), "gpt2", "llama", "qwen2", "mistral")


@pytest.mark.parametrize("levels,gammas,words", [
    ("ngram,retrieval", None, ["no 'full' level", "valid stacks"]),
    ("full,ngram", None, ["does not end with 'full'", "valid stacks"]),
    ("h3,full", None, ["unknown level kind 'h3'", "valid stacks"]),
    ("ngram,retrieval,full", "1,2,3", ["3 values for 2 boundaries", "valid stacks"]),
    ("draft,full", None, ["--draft PATH"]),
    ("full,kv4", None, ["does not end with 'full'", "kv4", "valid stacks"]),
    ("kv4:512,full", None, ["level 'kv4' takes no budget", "valid stacks"]),
])
def test_invalid_stack_is_one_line_exit_2_before_loading(levels, gammas, words):
    """Checked before anything loads: fast, one line, no traceback (the model path does not even exist)."""
    args = ["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf", "--levels", levels]
    r = run(*args, *(["--gammas", gammas] if gammas else []))
    _assert_user_error(r, *words)
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # five CLI runs, each a subprocess that imports torch
def test_print_stack_shows_what_a_method_expands_to():
    r = run("generate", "--method", "triforce", "--gamma", "5", "--gamma-draft", "2", "--print-stack")
    assert r.returncode == 0 and r.stdout.strip() == "ngram,retrieval,full --gammas 2,5"  # gammas given: fixed
    r = run("generate", "--print-stack")  # the default: adaptive, from the default gammas
    assert r.returncode == 0 and r.stdout.strip().startswith("ngram,retrieval,full --gammas 3,4 (adaptive")
    r = run("generate", "--no-adapt", "--print-stack")
    assert r.stdout.strip() == "ngram,retrieval,full --gammas 3,4"
    r = run("generate", "--levels", "ngram,streaming:600,retrieval:1024,full", "--gammas", "3", "--print-stack")
    assert r.stdout.strip() == "ngram,streaming:600,retrieval:1024,full --gammas 3,3,3"
    r = run("generate", "--method", "quantspec", "--gamma", "6", "--print-stack")
    assert r.returncode == 0 and r.stdout.strip() == "kv4,full --gammas 6"


def test_unknown_option_and_missing_prompt():
    r = run("generate", "--promtp", "hi")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


needs_model = pytest.mark.skipif(not embedded_available(), reason="embedded model not installed")


@needs_model
@pytest.mark.parametrize("args,words", [
    (["--prompt", "   "], ["prompt is empty"]),
    ([], ["exactly one of"]),
    (["--prompt", "hi", "--temperature", "-1"], ["--temperature"]),
    (["--prompt", "hi", "--top-p", "2"], ["--top-p"]),
    (["--prompt", "hi", "--threads", "0"], ["--threads", ">= 1"]),
    (["--demo-tokens", "200", "--max-context", "100"], ["exceeds the context", "--max-context"]),
    (["--prompt-file", "/nonexistent/prompt.txt"], ["cannot read the prompt file"]),
    (["--demo-tokens", "100", "--budget", "40000"], ["--budget 40000", "context"]),
    (["--demo-tokens", "100", "--method", "draft"], ["--draft PATH"]),
    (["--demo-tokens", "100", "--levels", "ngram,retrieval:40000,full"], ["retrieval:40000", "context"]),
    (["--demo-tokens", "100", "--levels", "ngram,streaming:8,full"], ["streaming:8", "sink"]),
])
def test_bad_requests_are_clear_errors(args, words):
    _assert_user_error(run("generate", "--quiet", *args), *words)


@needs_model
def test_generate_json_on_embedded_model(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("To be, or not to be, that is the question:")
    r = run("generate", "--prompt-file", str(prompt), "--max-new-tokens", "8", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "token_ids", "prompt_tokens", "method", "seconds", "tokens_per_second"):
        assert key in out
    assert out["method"] == "triforce" and len(out["token_ids"]) == 8 and out["prompt_tokens"] > 5
    assert out["stats"]["levels"][0]["level"] == "full"
    # each round's provenance: its tokens and texts are the output's, its verifications the stats' counts
    from triforce.speculation.provenance import level_counts

    assert [t["id"] for r in out["rounds"] for t in r["tokens"]] == out["token_ids"]
    assert "".join(t["text"] for r in out["rounds"] for t in r["tokens"]) == out["text"]
    assert level_counts(out["rounds"]) == {lvl["level"]: {k: lvl[k] for k in ("rounds", "proposed", "accepted")}
                                           for lvl in out["stats"]["levels"] if lvl["role"] == "verify"}
    # lossless: the same greedy tokens as plain autoregressive decoding through the library
    from triforce.generate import generate_ar
    from triforce.loading import load_model

    m = load_model(progress=False)
    ids = m.tokenizer(prompt.read_text())["input_ids"]
    assert generate_ar(m.model, ids, 8).tokens == out["token_ids"]


@needs_model
def test_bench_writes_results(tmp_path):
    r = run("bench", "--context-lengths", "700", "--methods", "triforce,ngram", "--temperatures", "0,0.6",
            "--max-new-tokens", "8", "--budget", "256", "--recent", "32", "--out", str(tmp_path), "--quiet",
            "--peers", "transformers,transformers-lookup", "--kv-dtype", "fp32",  # the peers' cache is fp32
            "--genres", "dialogue")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {(x["method"], x["temperature"]) for x in rows} == {
        (m, t) for m in ("ar", "triforce", "ngram", "transformers", "transformers-lookup") for t in (0.0, 0.6)}
    for x in rows:
        for key in ("method", "context_length", "temperature", "ms_per_token", "speedup_vs_ar", "lossless", "acceptance"):
            assert key in x
        # transformers' prompt lookup continues the prompt greedily: it must reproduce ar's tokens too
        assert x["lossless"] is (True if x["temperature"] == 0 and x["method"] != "transformers" else None)
        assert x["floor_ms"] > 0
        if x["method"] == "triforce":  # each level's forward cost beside its own floor
            assert set(x["level_cost"]) == {"full", "retrieval"}
            assert x["level_cost"]["retrieval"]["floor_ms"] < x["level_cost"]["full"]["floor_ms"]
            assert all(c["ms_per_forward"] > 0 for c in x["level_cost"].values())
            # tokens per round per level (the adaptive stack's: its rounds over every route it ran)
            assert set(x["tokens_per_round"]) == {"full", "retrieval"} and x["tokens_per_round"]["full"] >= 1
        elif x["method"] == "ngram":
            assert x["shortcut"] is None and set(x["tokens_per_round"]) == {"full"}
    # ar is timed before and after the other methods; the mean is the baseline of every speedup in its group
    for t in (0.0, 0.6):
        ar = next(x for x in rows if x["method"] == "ar" and x["temperature"] == t)
        assert ar["speedup_vs_ar"] == 1.0 and any("before and after the other methods" in n for n in ar["notes"])
        first, second = map(float, re.search(r"methods: ([0-9.]+) and ([0-9.]+)", " ".join(ar["notes"])).groups())
        assert abs(ar["ms_per_token"] - (first + second) / 2) <= 0.01
        for x in rows:
            if x["temperature"] == t and x["method"] in ("triforce", "ngram"):
                assert x["speedup_vs_ar"] == round(ar["ms_per_token"] / x["ms_per_token"], 3)
    md = (tmp_path / "results.md").read_text()
    assert "| 700 | 0.0 | triforce |" in md and "tokens per round (per level)" in md
    assert "| 700 | dialogue | 0.6 |" in md and "adaptive / best fixed" in md  # the per-prompt table
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert all(sum(x["adaptive"]["routes"].values()) >= 1 for x in runs if x["method"] == "triforce")
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    # each prompt's prefill: its seconds, FLOPs and rate, and the rate against the build's measured peaks
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    (prefill,) = meta["prefills"]
    assert prefill["context_length"] == 700 and prefill["prompt_name"] == "dialogue" and prefill["seconds"] > 0
    assert prefill["gflop_per_s"] == pytest.approx(prefill["gflop"] / prefill["seconds"], rel=0.01, abs=0.1)
    assert "Prefill per prompt" in md and f"| 700 | dialogue | {prefill['seconds']:.2f} |" in md
    if meta["vector_peak_gflop_s"]:
        assert "of the FMA peak" in md
    # the time to a 256-token answer: the prefill, then 256 tokens at each method's measured rate
    ar = next(x for x in runs if x["method"] == "ar" and x["temperature"] == 0.0)
    assert "Time to a 256-token answer" in md
    assert f"| 700 | dialogue | 0.0 | ar {prefill['seconds'] + 0.256 * ar['ms_per_token']:.1f}," in md
    bad = run("bench", "--methods", "ar,medusa", "--quiet")
    assert bad.returncode == 2 and "unknown method" in bad.stderr
    bad = run("bench", "--peers", "vllm", "--quiet")
    assert bad.returncode == 2 and "unknown peer" in bad.stderr


@needs_model
def test_tune_predicts_and_checks(tmp_path):
    r = run("tune", "--context-length", "700", "--budgets", "128,256", "--max-gamma", "3", "--max-gamma-draft", "2",
            "--tokens", "8", "--recent", "32", "--json", "--quiet")  # --check is on by default
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["acceptance"]) == {"128", "256"} and len(out["top"]) > 1
    assert out["best"]["predicted_ms_per_token"] == min(x["predicted_ms_per_token"] for x in out["top"])
    assert 1 <= out["best"]["gamma"] <= 3 and 1 <= out["best"]["gamma_draft"] <= 2
    # the check ran the defaults and the best few predicted settings for real, the prediction's best among them
    check, defaults = out["check"], {k: getattr(SpecConfig(), k) for k in ("budget", "gamma", "gamma_draft")}
    ran = [c["flags"] for c in check["candidates"]]
    assert 1 <= len(ran) <= 4 and defaults not in ran and all(c["triforce_ms_per_token"] > 0 for c in check["candidates"])
    assert {k: out["best"][k] for k in defaults} in ran + [defaults]
    fastest = min(check["candidates"], key=lambda c: c["triforce_ms_per_token"])
    assert check["tuned"] == fastest  # its flags, prediction and timing
    # recorded as this machine's default for triforce (in the tests' own file: conftest): the fastest of those, or the
    # defaults where they ran faster (replacing what an earlier run recorded for this context and temperature)
    slower = fastest["triforce_ms_per_token"] > check["default"]["triforce_ms_per_token"]
    entries = [e for e in json.loads(Path(out["saved"]).read_text())["entries"]
               if e["kind"] == "chain" and e["context_length"] == 700 and e["temperature"] == 0.0]
    assert len(entries) == 1
    assert entries[0]["flags"] == out["recorded"] == (defaults if slower else check["tuned"]["flags"])
    assert ("kept_defaults" in out) == slower
    bad = run("tune", "--context-length", "700", "--budgets", "1024", "--quiet")
    assert bad.returncode == 2 and "budget" in bad.stderr


@needs_model
def test_tune_trees(tmp_path):
    """`tune --trees`: the probe's acceptance per child rank (rank 0 tried at every path slot), forward
    costs, and the best widths-per-depth tree as flags that parse."""
    from triforce.speculation.stack import StackSpec

    r = run("tune", "--trees", "--context-length", "600", "--tokens", "16", "--json", "--quiet", "--sink", "4",
            "--window", "64", "--max-tree-nodes", "6")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    acc, tried = out["acceptance_by_rank"], out["tried_by_rank"]
    assert len(acc) == 4 and all(0 <= a <= 1 for a in acc) and tried[0] >= max(tried) and tried[0] > 0
    assert out["best"]["predicted_ms_per_token"] == min(x["predicted_ms_per_token"] for x in out["top"])
    assert all(x["nodes"] <= 6 for x in out["top"])
    assert StackSpec.parse("streaming,full", 4, tree=out["best"]["tree"]).tree_nodes == out["best"]["nodes"]
    # --check (the default) ran the tree, the chain defaults and ar: the tree is recorded only if it beat the defaults
    check = out["check"]
    assert all(check[k] > 0 for k in ("tuned_ms_per_token", "default_ms_per_token", "ar_ms_per_token"))
    if check["tuned_ms_per_token"] < check["default_ms_per_token"]:
        assert out["saved"] and out["recorded"] == {"tree": out["best"]["tree"]}
    else:
        assert out["saved"] is None and out["recorded"] is None and out["kept_defaults"]
        r = run("tune", "--trees", "--no-check", "--context-length", "600", "--tokens", "16", "--json", "--quiet",
                "--sink", "4", "--window", "64", "--max-tree-nodes", "6")  # unchecked: the prediction is recorded
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert "check" not in out
    # recorded: sequoia takes that tree by default at a context near 600 (greedy), not with --no-tuned or --tree
    assert out["saved"]
    gen = ("generate", "--method", "sequoia", "--demo-tokens", "500", "--max-new-tokens", "8", "--json", "--sink", "4",
           "--window", "64")  # the threads tune ran with: a tuned entry holds for its thread count
    r = run(*gen)
    assert r.returncode == 0, r.stderr
    tuned = json.loads(r.stdout)
    assert tuned["tuned"].startswith(f"--tree {out['best']['tree']} (tuned at context 600, T=0")
    assert "with this machine's tuned flags --tree" in r.stderr
    for flag in (["--no-tuned"], ["--tree", "2,1"]):
        r = run(*gen, *flag)
        assert r.returncode == 0 and json.loads(r.stdout)["tuned"] is None, r.stderr
        assert json.loads(r.stdout)["token_ids"] == tuned["token_ids"]  # greedy: the same tokens whatever the tree
    # bench too: its sequoia row says which flags it took, and stays lossless
    r = run("bench", "--context-lengths", "600", "--methods", "sequoia", "--temperatures", "0", "--max-new-tokens", "8",
            "--sink", "4", "--window", "64", "--out", str(tmp_path), "--quiet")
    assert r.returncode == 0, r.stderr
    row, = [x for x in json.loads((tmp_path / "results.json").read_text())["rows"] if x["method"] == "sequoia"]
    assert row["notes"][0].startswith(f"tuned flags (triforce tune): --tree {out['best']['tree']} (tuned at context 600")
    assert row["lossless"] and f"| sequoia (tuned: --tree {out['best']['tree']}) |" in (tmp_path / "results.md").read_text()


@needs_model
def test_bench_on_the_users_own_files(tmp_path):
    from triforce.corpus import demo_tokens
    from triforce.loading import load_model

    tok = load_model(progress=False).tokenizer
    long_file, short_file = tmp_path / "long.txt", tmp_path / "short.txt"
    long_file.write_text(tok.decode(demo_tokens(tok, 900, offset_chars=50_000)))
    short_file.write_text("Too short to be a 600-token prompt.")
    out = tmp_path / "out"
    r = run("bench", "--context-lengths", "600", "--methods", "ngram", "--temperatures", "0", "--max-new-tokens", "4",
            "--prompt-file", str(long_file), "--prompt-file", str(short_file), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "skip" in r.stderr and "short.txt" in r.stderr
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert {x["method"] for x in runs} == {"ar", "ngram"} and all(x["prompt"] == 0 for x in runs)
    bad = run("bench", "--prompt-file", str(tmp_path / "missing.txt"), "--quiet")
    assert bad.returncode == 2 and "prompt file not found" in bad.stderr


@needs_model
def test_bench_runs_user_stacks_beside_methods(tmp_path):
    r = run("bench", "--context-lengths", "600", "--methods", "ngram", "--stacks",
            "ngram,streaming:100,full@2,3;streaming:100,full@4", "--temperatures", "0", "--max-new-tokens", "6",
            "--out", str(tmp_path / "b"), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = {x["method"]: x for x in json.loads((tmp_path / "b" / "results.json").read_text())["rows"]}
    assert set(rows) == {"ar", "ngram", "ngram,streaming:100,full --gammas 2,3", "streaming:100,full --gammas 4"}
    assert all(x["lossless"] for x in rows.values())
    assert "streaming:100" in rows["ngram,streaming:100,full --gammas 2,3"]["level_cost"]
    bad = run("bench", "--stacks", "ngram,retrieval", "--quiet")
    assert bad.returncode == 2 and "no 'full' level" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # a `triforce bench` of six runs in a subprocess
def test_bench_interleaves_several_runs_per_method(tmp_path):
    r = run("bench", "--context-lengths", "600", "--methods", "ngram", "--temperatures", "0,0.7", "--samples", "3",
            "--max-new-tokens", "6", "--out", str(tmp_path), "--quiet", "--genres", "code")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    sampled = [x for x in rows if x["temperature"] > 0]
    greedy = [x for x in rows if x["temperature"] == 0]
    assert len(sampled) == len(greedy) == 2 and all(x["ms_per_token"] > 0 for x in rows)
    for x in rows:  # every run counted; only sampled runs have seeds of their own
        (note,) = [n for n in x["notes"] if n.startswith("3 runs interleaved")]
        assert "(18 tokens" in note and ("each its own seed" not in note or x["temperature"] > 0)
        assert x["lossless"] is (True if x["temperature"] == 0 else None)
    from types import SimpleNamespace

    from triforce.bench.methods import _ms_per_token, _summed_levels
    runs = [SimpleNamespace(decode_seconds=t, tokens=[0] * n, stats={"levels": [
        {"level": "full", "role": "verify", "rounds": r, "proposed": p, "accepted": a, "seconds": t, "forwards": r}]})
        for t, n, r, p, a in ((1.0, 10, 4, 12, 6), (3.0, 10, 10, 30, 0))]
    assert _ms_per_token(runs) == pytest.approx(200.0)  # 4 s over 20 tokens
    (full,) = _summed_levels(runs)
    assert (full["rounds"], full["proposed"], full["accepted"]) == (14, 42, 6)
    assert full["acceptance_rate"] == round(6 / 42, 4) and full["tokens_per_round"] == round(20 / 14, 3)


@needs_model
def test_bench_compares_with_a_reference_kv_dtype(tmp_path):
    """--reference-kv-dtype: ar over a cache of that dtype, prefilled on its own, and every method's speedup over it
    (issue 17: an int8 run's methods against fp32 ar, the gain end to end)."""
    r = run("bench", "--context-lengths", "600", "--methods", "ngram", "--temperatures", "0,0.6", "--max-new-tokens",
            "4", "--kv-dtype", "int8", "--reference-kv-dtype", "fp32", "--out", str(tmp_path / "b"), "--quiet")
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "b" / "results.json").read_text())
    assert result["meta"]["kv_dtype"] == "int8" and result["meta"]["reference_kv_dtype"] == "fp32"
    rows = {(x["method"], x["temperature"]): x for x in result["rows"]}
    assert set(rows) == {(m, t) for m in ("ar", "ngram", "ar (fp32 KV)") for t in (0.0, 0.6)}
    for t in (0.0, 0.6):
        ref, ar = rows["ar (fp32 KV)", t], rows["ar", t]
        assert ref["reference"] and ref["speedup_vs_reference"] == 1.0 and ref["lossless"] is None
        for m in ("ar", "ngram"):  # each method's speedup over the reference: its ms/token against the reference's
            x = rows[m, t]
            # a median of per-run ratios of the reference's time over the method's (each timed run is noisy: the
            # summary's ratio lies within the runs' own ratios, against any of the reference's runs)
            runs = [y for y in result["runs"] if y["temperature"] == t]
            refs = [y["ms_per_token"] for y in runs if y.get("reference")]
            mine = [y["ms_per_token"] for y in runs if y["method"] == m and not y.get("reference")]
            ratios = [a / b for a in refs for b in mine]
            assert not x["reference"] and min(ratios) - 0.002 <= x["speedup_vs_reference"] <= max(ratios) + 0.002
        assert ar["speedup_vs_ar"] == 1.0 and rows["ngram", 0.0]["lossless"]
    assert "| speedup vs ar (fp32 KV)" in (tmp_path / "b" / "results.md").read_text()
    bad = run("bench", "--kv-dtype", "fp16", "--reference-kv-dtype", "fp16", "--quiet")
    assert bad.returncode == 2 and "this run's own KV dtype" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_refuses_an_int8_kv_cache():
    """Its prefix cache stores float K/V blocks: one line, exit 2, before loading anything."""
    r = run("serve", "--kv-dtype", "int8", "--port", "8931")
    _assert_user_error(r, "does not support --kv-dtype int8", "fp16")
    assert len(r.stderr.strip().splitlines()) == 1
