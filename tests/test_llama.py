"""Our Llama-family forward against transformers' own models, and the static KV cache's contract."""

from __future__ import annotations

import pytest
import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig

VARIANTS = [(kind, tied) for kind in ("llama", "mistral", "qwen2", "qwen3") for tied in (False, True)]


def ours_from(hf) -> CausalLM:
    """Our model holding the weights of a transformers model (read through its config dict)."""
    model = CausalLM(ModelConfig.from_hf(hf.config.to_dict()))
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    missing, _ = model.load_state_dict(state, strict=False)
    assert not missing
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair(build_hf):
    hf = build_hf("llama")
    return hf, ours_from(hf)


@pytest.fixture(scope="module")
def model(pair) -> CausalLM:
    return pair[1]


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def run(model: CausalLM, toks: torch.Tensor, start: list[int] | int = 0, cache=None, capacity: int = 64):
    cache = cache if cache is not None else model.new_cache(toks.shape[0], capacity)
    start_pos = torch.tensor(start if isinstance(start, list) else [start] * toks.shape[0])
    return model(toks, cache, start_pos), cache


@pytest.mark.parametrize(("kind", "tied"), VARIANTS)
@torch.no_grad()
def test_logits_match_transformers(build_hf, kind, tied):
    hf = build_hf(kind, tied)
    ours = ours_from(hf)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied
    toks = tokens(2, 12)
    expected = hf(toks).logits
    got, _ = run(ours, toks)
    assert expected.abs().max() > 1.0  # logits large enough that a wrong bias or norm would show
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_config_reads_architecture_switches(build_hf):
    assert ModelConfig.from_hf(build_hf("qwen2").config.to_dict()).attention_bias
    assert ModelConfig.from_hf(build_hf("qwen3").config.to_dict()).qk_norm
    c = ModelConfig.from_hf(build_hf("llama").config.to_dict())
    assert (c.attention_bias, c.qk_norm, c.num_kv_heads, c.head_dim, c.group_size) == (False, False, 2, 8, 2)


@pytest.mark.parametrize("chunk", [1, 3])
@torch.no_grad()
def test_incremental_decoding_equals_full_forward(model, chunk):
    toks = tokens(2, 14)
    full, _ = run(model, toks)
    prefix = 5
    parts, cache = run(model, toks[:, :prefix])
    pieces = [parts]
    for s in range(prefix, 14, chunk):
        out, _ = run(model, toks[:, s : s + chunk], s, cache)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ragged_batch_rows_match_running_alone(model):
    lengths = [7, 3, 5]
    prompts = tokens(3, 7, seed=2)  # row b's prompt is prompts[b, :lengths[b]]; the rest is padding
    nxt = tokens(3, 2, seed=3)
    first, cache = run(model, prompts)
    second, _ = run(model, nxt, lengths, cache)  # each row continues from its own length
    for b, n in enumerate(lengths):
        alone, _ = run(model, torch.cat([prompts[b : b + 1, :n], nxt[b : b + 1]], dim=1))
        torch.testing.assert_close(first[b, :n], alone[0, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second[b], alone[0, n:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rejected_drafts_need_no_rollback(model):
    prefix, real, garbage = tokens(2, 6, seed=4), tokens(2, 3, seed=5), tokens(2, 5, seed=6)
    _, clean = run(model, prefix)
    expected, _ = run(model, real, [6, 6], clean)

    _, dirty = run(model, prefix)
    run(model, garbage, [6, 6], dirty)  # drafts written to slots 6..10, then all rejected
    got, _ = run(model, real, [6, 6], dirty)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_partly_accepted_draft_continues_from_accepted_length(model):
    seq = tokens(1, 12, seed=7)
    full, _ = run(model, seq)
    _, cache = run(model, seq[:, :6])
    draft = seq[:, 6:10].clone()
    draft[0, 2:] = (draft[0, 2:] + 1) % 64  # first two drafts right, the rest wrong
    run(model, draft, 6, cache)
    got, _ = run(model, seq[:, 8:12], 8, cache)
    torch.testing.assert_close(got, full[:, 8:12], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_keep_rows_keeps_the_right_rows(model):
    prompts, nxt = tokens(3, 6, seed=8), tokens(3, 1, seed=9)
    _, cache = run(model, prompts)
    expected, _ = run(model, nxt, 6, cache)
    _, cache = run(model, prompts)
    keep = torch.tensor([2, 0])
    cache.keep_rows(keep)
    assert cache.batch == 2
    got, _ = run(model, nxt[keep], 6, cache)
    torch.testing.assert_close(got, expected[keep], atol=1e-6, rtol=1e-6)


def test_truncated_and_sublayers_share_weights(model):
    t = model.truncated(2)
    assert t.config.num_layers == 2 and len(t.layers) == 2
    assert t.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert t.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert t.layers[1].mlp.up_proj.weight.data_ptr() == model.layers[1].mlp.up_proj.weight.data_ptr()
    s = model.sublayers([0, 2])
    assert s.layers[1].self_attn.q_proj.weight.data_ptr() == model.layers[2].self_attn.q_proj.weight.data_ptr()
    assert len(s.new_cache(1, 8).k) == 2
    out, _ = run(s, tokens(1, 4))
    assert out.shape == (1, 4, 64)


@torch.no_grad()
def test_truncated_to_all_layers_is_the_model(model):
    toks = tokens(1, 5)
    torch.testing.assert_close(run(model.truncated(3), toks)[0], run(model, toks)[0])


@pytest.mark.parametrize("ids", [[], [3], [-1], [2, 0], [1, 1]])
def test_sublayers_refuses_bad_ids(model, ids):
    with pytest.raises(SpecdecError, match="draft layers"):
        model.sublayers(ids)


@pytest.mark.parametrize("n", [0, 4])
def test_truncated_refuses_bad_depth(model, n):
    with pytest.raises(SpecdecError):
        model.truncated(n)


@torch.no_grad()
def test_capacity_overflow_is_refused(model):
    cache = model.new_cache(1, 8)
    run(model, tokens(1, 3), 5, cache)  # exactly fills slots 5..7
    with pytest.raises(SpecdecError, match="KV slots"):
        run(model, tokens(1, 3), 6, cache)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gpt2"}, "gpt2"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "sliding-window"),
    ],
)
def test_from_hf_refuses_what_it_cannot_run(build_hf, change, named):
    hf = build_hf("llama").config.to_dict()
    if "rope_scaling" in change:  # a transformers 4 config.json: rope_scaling and no rope_parameters
        hf.pop("rope_parameters")
    hf.update(change)
    with pytest.raises(SpecdecError, match=named):
        ModelConfig.from_hf(hf)


def test_from_hf_accepts_an_unused_sliding_window(build_hf):
    hf = {**build_hf("qwen2").config.to_dict(), "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf(hf).model_type == "qwen2"
