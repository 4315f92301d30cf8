"""speculators' own from_pretrained on head folders this tool writes (exporters/speculators_head_check.py), with the
target's folder as the verifier. Skipped where SPECDEC_TUNE_SPECULATORS_PYTHON names no speculators virtualenv."""

from __future__ import annotations

import os

import pytest
import torch

from specdec_tune.exporters.speculators_head_check import check_speculators_head
from specdec_tune.profiles.drafters.checkpoints import save_head
from specdec_tune.profiles.drafters.heads import head_kind
from specdec_tune.profiles.models.loading import load_model

pytestmark = pytest.mark.skipif(
    not os.environ.get("SPECDEC_TUNE_SPECULATORS_PYTHON"), reason="SPECDEC_TUNE_SPECULATORS_PYTHON names no virtualenv"
)
TARGET = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("mechanism", ["eagle3", "dflash", "dspark"])
def test_speculators_loads_every_tensor_of_a_written_head(hf_variant_dir, tmp_path, mechanism):
    import specdec_tune.profiles.drafters.dflash  # noqa: F401  (registers the head kinds)
    import specdec_tune.profiles.drafters.eagle3  # noqa: F401

    torch.manual_seed(0)
    folder = hf_variant_dir("llama", **TARGET)
    target = load_model(str(folder), dtype="float32")
    options = {"draft_vocab": list(range(0, 64, 2))} if mechanism == "eagle3" else {}
    head = save_head(
        head_kind(mechanism).new(target.model, seed=0, **options),
        mechanism,
        tmp_path / mechanism,
        verifier="a-hub-id-that-is-never-fetched",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
    )
    result = check_speculators_head(head, folder)
    assert result["error"] is None and result["ok"], result
    assert result["steps_run"] == ["from_pretrained"] and result["dropped"] == []
