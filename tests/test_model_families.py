"""The model-family coverage bench (bench/model_families.py) on a fixed sample: a built-in family, three families of the
generic path that decode token-identical to transformers, a state-space family and an encoder-decoder that the tool
refuses (or, once it runs them, decodes token-identical: never a silent divergence, never a traceback); the
classification of a wider set from configs alone; the table's counts; the walk through worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import model_families as mf  # noqa: E402  (bench/ is a folder of scripts)

NEW_TOKENS = 16  # the bench decodes 24; fewer keep this under a minute on two cores

# family -> (kind, the path it loads through where it must load, the statuses it may end in)
LOSSLESS_OR_REFUSED = ("refused", "identical")
SAMPLE = {
    "llama": ("attention decoder", "builtin", ("identical",)),
    "gemma2": ("attention decoder", "generic", ("identical",)),  # sliding window, soft-capping
    "gpt2": ("attention decoder", "generic", ("identical",)),  # learned absolute positions, fused qkv
    # per-layer input embeddings and KV shared across layers: its draft, a first-layers cut, keeps the stack's tables
    "gemma4_text": ("attention decoder", "generic", ("identical",)),
    "mamba": ("ssm-recurrent-hybrid", None, LOSSLESS_OR_REFUSED),  # refused today
    "prophetnet": ("other", None, LOSSLESS_OR_REFUSED),  # an encoder-decoder's decoder half, refused today
}


@pytest.fixture(scope="module")
def prompts():
    """The bench's prompts: the demo tokenizer's, or random tokens with a small vocabulary without the demo."""
    tokens, vocab, _ = mf.demo_prompts()
    return tokens, vocab


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_TUNE_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("family", sorted(SAMPLE))
def test_a_family_through_the_bench(prompts, family):
    tokens, vocab = prompts
    kind, path, statuses = SAMPLE[family]
    rec = mf.run_family(family, tokens, vocab, new_tokens=NEW_TOKENS, timeout_s=60)
    assert rec["kind"] == kind, rec.get("kind_why")
    assert rec["status"] != "traceback", rec.get("traceback")
    assert rec["built"], rec.get("build_attempts")
    assert rec["status"] in statuses, rec.get("why")
    if path is not None:
        assert rec.get("path") == path
    if rec["status"] == "identical":
        for mode in mf.MODES:
            for batch in mf.BATCHES:
                assert rec["modes"][mode][f"b{batch}"]["identical"], (mode, batch, rec["modes"][mode])
        assert rec["modes"]["self_draft"]["b1"]["accepted"] > 0  # the target as its own draft: drafts are accepted
        assert rec["prompt_lengths"][0] != rec["prompt_lengths"][1]  # batch 2 is ragged
    else:
        assert rec["load"] == "refused" and rec["why"] and "\n" not in rec["why"]
    if kind == "other":
        assert rec["kind_why"].startswith("encoder-decoder")
    assert rec["seconds"]["total"] > 0


@pytest.mark.parametrize(
    "family, kind",
    [
        ("llama", "attention decoder"),
        ("gpt2", "attention decoder"),
        ("gemma3_text", "attention decoder"),
        ("mixtral", "attention decoder"),
        ("deepseek_v3", "attention decoder"),
        ("mamba", "ssm-recurrent-hybrid"),
        ("mamba2", "ssm-recurrent-hybrid"),
        ("rwkv", "ssm-recurrent-hybrid"),
        ("jamba", "ssm-recurrent-hybrid"),
        ("zamba", "ssm-recurrent-hybrid"),
        ("falcon_h1", "ssm-recurrent-hybrid"),
        ("recurrent_gemma", "ssm-recurrent-hybrid"),
        ("xlstm", "ssm-recurrent-hybrid"),
        ("bamba", "ssm-recurrent-hybrid"),
        ("lfm2", "ssm-recurrent-hybrid"),
        ("qwen3_next", "ssm-recurrent-hybrid"),
        ("nemotron_h", "ssm-recurrent-hybrid"),
        ("bart", "other"),
        ("whisper", "other"),
        ("bert", "other"),
        ("gemma3", "other"),
    ],
)
def test_classification_from_the_config_alone(family, kind):
    got, why = mf.classify_family(family)
    assert got == kind, why


def test_a_tiny_config_keeps_every_layer_kind_of_the_default():
    model, config, tried, vocab = mf.build("gemma3_text", 512)
    assert config.num_hidden_layers <= 6 and config.hidden_size == 64
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}  # the default has 5 sliding : 1 full
    assert config.sliding_window == 8 and vocab == 512
    assert tried[-1].endswith("built")


def test_the_table_counts_what_the_records_say():
    def rec(name, kind, status, **extra):
        return {"model_type": name, "kind": kind, "kind_why": "x: y", "status": status, "seconds": {"total": 1}} | extra

    cells = {m: {f"b{b}": {"identical": True, "accepted": 1} for b in mf.BATCHES} for m in mf.MODES}
    records = [
        rec("a", "attention decoder", "identical", modes=cells, path="generic"),
        rec("b", "attention decoder", "refused", why="one line"),
        rec("c", "attention decoder", "traceback", why="load: KeyError"),
        rec("d", "ssm-recurrent-hybrid", "refused", why="no"),
        rec("e", "other", "not built", why="cannot build tiny: x"),
    ]
    s = mf.summary(records)
    assert (s["attention_decoders"], s["attention_identical_all_modes"], s["attention_identical_pct"]) == (3, 1, 33.3)
    assert (s["attention_refused"], s["attention_tracebacks"], s["tracebacks_all_kinds"]) == (1, 1, 1)
    assert s["identical_with_accepted_drafts"] == {"ngram": 1, "draft_model": 1, "self_draft": 1}
    assert s["by_kind"]["ssm-recurrent-hybrid"] == {"families": 1, "by_status": {"refused": 1}}
    result = {
        "transformers": "t",
        "families_run": 5,
        "all_families_in_mapping": 5,
        "wall_s": 1.0,
        "machine": "m",
        "workers": 1,
        "method": {"prompts": "p", "new_tokens": 1, "draft_len": 1},
        "summary": s,
        "families": records,
    }
    text = mf.table(result)
    assert "**3**" in text and "**1** (33.3%)" in text
    assert "| a | attention decoder | generic | identical | = = | = = | = = | = = |" in text
    assert "| e | other |  | not built |  |  |  |  |" in text


def test_the_walk_runs_families_in_workers_and_writes_the_result(tmp_path):
    out = tmp_path / "families.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "model_families.py"),
            "--families",
            "qwen2,qwen3_next",
            "--workers",
            "1",
            "--new-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "bench",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    by = {r["model_type"]: r for r in result["families"]}
    assert by["qwen2"]["status"] == "identical" and by["qwen2"]["path"] == "builtin"
    assert by["qwen3_next"]["kind"] == "ssm-recurrent-hybrid" and by["qwen3_next"]["status"] == "refused"
    assert result["summary"]["tracebacks_all_kinds"] == 0
    assert out.with_suffix(".md").read_text().startswith("# transformers' causal-LM families")
