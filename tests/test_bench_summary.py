"""`triforce bench --prompts N`'s summary: every ratio is the median of the per-prompt ratios (each against its own
prompt's baseline), and the table's header says so; with one prompt the table reads as before."""
from triforce.bench import methods, results


def _rows(ar, fast, reference=None, llama=None):
    """Per-prompt rows of one context and temperature: ar's ms/token, a method's, and optionally a reference ar's
    and a llama.cpp peer's, prompt by prompt."""
    rows = []
    for pi, (a, f) in enumerate(zip(ar, fast)):
        rows.append(methods._row("ar", 8192, pi, 0.0, a, a, 10.0, [1], [1]))
        rows.append(methods._row("ngram", 8192, pi, 0.0, f, a, 10.0, [1], [1]))
        if reference:
            row = methods._row("ar (fp32 KV)", 8192, pi, 0.0, reference[pi], a, 10.0, [1], [1])
            row["lossless"], row["reference"] = None, True
            rows.append(row)
        if llama:
            row = methods._row("llama.cpp", 8192, pi, 0.0, llama[pi], a, 10.0, [1], [1])
            row.update(prefill_tokens_per_s=100.0, ours_prefill_tokens_per_s=200.0)
            rows.append(row)
    return rows


def test_speedups_are_medians_of_per_prompt_ratios_and_the_header_says_so():
    # per prompt: ar 10 / 20 / 40, ngram 5 / 16 / 10 -> ratios 2.0, 1.25, 4.0 (median 2.0); the medians' ratio,
    # 20 / 10 = 2.0 here by chance, so the reference and the peer make the difference visible
    rows = _rows([10.0, 20.0, 40.0], [5.0, 16.0, 10.0], reference=[30.0, 20.0, 80.0], llama=[30.0, 30.0, 200.0])
    summary = {r["method"]: r for r in results.summarize(rows)}
    assert summary["ngram"]["speedup_vs_ar"] == 2.0
    # reference / ngram per prompt: 6.0, 1.25, 8.0 -> 6.0 (the medians' ratio would be 30 / 10 = 3.0)
    assert summary["ngram"]["speedup_vs_reference"] == 6.0
    # llama.cpp / ar per prompt: 3.0, 1.5, 5.0 -> 3.0 (the medians' ratio would be 30 / 20 = 1.5)
    assert summary["llama.cpp"]["ar_faster_by"] == 3.0
    md = results.markdown(list(summary.values()))
    assert "| ms/token (median of 3 prompts) | speedup vs ar (median of per-prompt ratios) |" in md
    assert "speedup vs ar (fp32 KV) (median of per-prompt ratios) |" in md
    assert "our ar faster by (median of per-prompt ratios) |" in md and "| 3.0x |" in md
    ngram = next(line for line in md.splitlines() if "| ngram |" in line)
    assert "| 2.0x | 6.0x |" in ngram


def test_one_prompt_keeps_the_plain_header_and_the_same_ratios():
    rows = _rows([20.0], [8.0], reference=[30.0], llama=[50.0])
    summary = {r["method"]: r for r in results.summarize(rows)}
    assert summary["ngram"]["speedup_vs_ar"] == 2.5 and summary["ngram"]["speedup_vs_reference"] == 3.75
    assert summary["llama.cpp"]["ar_faster_by"] == 2.5
    md = results.markdown(list(summary.values()))
    assert md.startswith("| context | T | method | ms/token | speedup vs ar | speedup vs ar (fp32 KV) | lossless |")
    assert "median" not in md
