"""EAGLE-3, MTP, DFlash and DSpark heads on tiny random models: the target's hidden-state capture, the head's cache
against a from-scratch draft, training-time test against drafting, the speculators / Model-Optimizer loaders and their
verifier checks, profiling, and (demo) a trained head written by train-drafter loading back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec_tune import SpecdecError
from specdec_tune.cli import main
from specdec_tune.profiles.drafters.base import Draft, DraftRequest
from specdec_tune.profiles.drafters.checkpoints import load_head, save_head
from specdec_tune.profiles.drafters.dflash import DFlashDrafter, DSparkDrafter, new_dflash_head
from specdec_tune.profiles.drafters.eagle3 import Eagle3Drafter, new_eagle3_head
from specdec_tune.profiles.drafters.heads import HeadDrafter
from specdec_tune.profiles.drafters.mtp import MtpDrafter, new_mtp_head
from specdec_tune.profiles.models.folders import ModelRef
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig, init_random
from specdec_tune.profiles.models.loading import LoadedModel
from specdec_tune.profiles.specdec import generate
from specdec_tune.profiles.train_drafter import TeacherData, TrainSettings, ttt_loss, ttt_mask


def tiny_model(vocab: int = 64, layers: int = 6, seed: int = 0) -> CausalLM:
    c = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return init_random(CausalLM(c), seed=seed).eval().requires_grad_(False)


def loaded(model: CausalLM) -> LoadedModel:
    return LoadedModel(
        model=model, tokenizer=None, ref=ModelRef("tiny", "hf", "llama", "float32", "c", "w", model.config.num_layers)
    )


PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7], [9, 3, 9, 3, 9, 3, 9], [4]]
HEADS = {
    "eagle3": lambda m: new_eagle3_head(m, draft_vocab=list(range(0, 64, 3)), seed=1),
    "mtp": lambda m: new_mtp_head(m, seed=1),
    "dflash": lambda m: new_dflash_head(m, draft_vocab=list(range(0, 64, 3)), block_size=5, seed=1),
    "dspark": lambda m: new_dflash_head(m, markov_rank=8, markov_head_type="rnn", block_size=4, seed=1),
}
DRAFTERS = {"eagle3": Eagle3Drafter, "mtp": MtpDrafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}
MECHANISMS = list(DRAFTERS)


@pytest.fixture(scope="module")
def target():
    return tiny_model(vocab=64, layers=6, seed=3)


def states(model, tokens: list[int], layers) -> torch.Tensor:
    """The target's states at `layers` for every position of `tokens`, from scratch: [len, W]."""
    cache = model.new_cache(1, len(tokens) + 1)
    _, hidden = model.forward_capture(
        torch.tensor([tokens]), cache, torch.zeros(1, dtype=torch.long), tuple(layers), logits="none"
    )
    return hidden[0]


# ---------------------------------------------------------------------------- capture


def test_forward_capture_matches_forward_and_names_layers_as_hugging_face_does(target):
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    start = torch.zeros(1, dtype=torch.long)
    plain = target(tokens, target.new_cache(1, 8), start)
    logits, hidden = target.forward_capture(tokens, target.new_cache(1, 8), start, (0, 2, 6))
    assert torch.equal(logits, plain)
    H = target.config.hidden_size
    assert hidden.shape == (1, 6, 3 * H)
    assert torch.equal(hidden[..., :H], target.embed_tokens(tokens))  # id 0: the state entering layer 0
    final = target(tokens, target.new_cache(1, 8), start, logits="hidden")
    assert torch.equal(hidden[..., 2 * H :], final)  # id num_layers: the final-normed state
    three = target.truncated(3)  # the state entering layer 2 depends on layers 0 and 1 only
    assert torch.equal(
        hidden[..., H : 2 * H], three.forward_capture(tokens, three.new_cache(1, 8), start, (2,), logits="none")[1]
    )
    with pytest.raises(SpecdecError, match="not in 0..6"):
        target.forward_capture(tokens, target.new_cache(1, 8), start, (7,))


# ---------------------------------------------------------------------------- the head's cache


class FromScratch(HeadDrafter):
    """Checks every incremental proposal against a fresh head given the whole sequence's states at once."""

    name = "from-scratch"

    def __init__(self, inner: HeadDrafter, model) -> None:
        self.inner, self.model, self.hidden_layers, self.checked = inner, model, inner.hidden_layers, 0

    def start(self, prompts):
        self.inner.start(prompts)

    def keep_rows(self, indices):
        self.inner.keep_rows(indices)

    def propose(self, request: DraftRequest) -> Draft:
        out = self.inner.propose(request)
        for seq, m, got in zip(request.token_ids, request.max_tokens, out.tokens):
            if len(seq) < 2:
                continue
            fresh = type(self.inner).from_head(self.inner.head)
            fresh.start([seq])
            full = states(self.model, seq[:-1], self.hidden_layers)[None]  # [1, len-1, W]
            want = fresh.propose(DraftRequest([seq], [m], 0.0, hidden_states=full, num_hidden=[len(seq) - 1])).tokens[0]
            assert got == want, f"incremental draft {got} differs from the from-scratch draft {want} after {seq}"
            self.checked += 1
        return out


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_incremental_drafts_equal_drafts_from_scratch(target, mechanism):
    """The head's cache after catch-up and rollback holds what a fresh run over the sequence would: every round's
    proposals (1, 2 or 4 verified positions since the last round, at batch 4 with rows finishing) match."""
    head = HEADS[mechanism](target)
    check = FromScratch(DRAFTERS[mechanism].from_head(head), target)
    plain = generate(target, PROMPTS, max_new_tokens=24).tokens
    out = generate(target, PROMPTS, drafter=check, num_draft_tokens=3, max_new_tokens=24)
    assert out.tokens == plain
    assert check.checked > 20


def test_a_request_without_hidden_states_or_out_of_line_is_refused(target):
    drafter = Eagle3Drafter(loaded(target), Eagle3Drafter.Options(random=True))
    drafter.start([[1, 2, 3]])
    with pytest.raises(SpecdecError, match="needs the target's hidden states"):
        drafter.propose(DraftRequest([[1, 2, 3]], [2], 0.0))
    W = len(drafter.hidden_layers) * target.config.hidden_size
    with pytest.raises(SpecdecError, match="hidden states for positions 1"):
        drafter.propose(DraftRequest([[1, 2, 3]], [2], 0.0, hidden_states=torch.zeros(1, 1, W), num_hidden=[1]))


# ---------------------------------------------------------------------------- training-time test


def test_ttt_mask_is_what_a_drafting_step_sees():
    m = ttt_mask(4, 3, "cpu")[0, 0].int()
    assert m.shape == (4, 12)
    assert m[2].tolist() == [1, 1, 1, 0] + [0, 0, 1, 0] + [0, 0, 1, 0]


@pytest.mark.parametrize("mechanism", ["eagle3", "mtp"])
def test_unrolled_training_steps_compute_what_drafting_computes(target, mechanism):
    """TTT step k's logits at position p equal the drafter's k-th draft logits for the sequence cut after x_{p+1}."""
    head = HEADS[mechanism](target)
    seq = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
    layers = head.hidden_layers
    full = states(target, seq, (*layers, target.config.num_layers))
    W = len(layers) * target.config.hidden_size
    captured = []
    original = head.features_with

    def spy(tokens, hidden, attend):
        features, carry = original(tokens, hidden, attend)
        captured.append(head.lm_head(features).float())
        return features, carry

    head.features_with = spy
    vocab = torch.arange(64) if mechanism == "mtp" else head.to_target_ids(torch.arange(head.draft_vocab_size))
    batch = {
        "tokens": torch.tensor([seq]),
        "aux": full[None, :, :W],
        "final": full[None, :, W:],
        "lengths": torch.tensor([len(seq)]),
    }
    with torch.no_grad():
        ttt_loss(head, batch, vocab, target.lm_head.weight[vocab], TrainSettings(ttt_steps=3))
    del head.features_with
    p = 4  # the sequence x_0..x_{p+1}: catch-up over positions 0..p, then drafts
    cache = head.new_cache(1, 16)
    with torch.no_grad():
        logits, carry = head.step(
            torch.tensor([seq[1 : p + 2]]),
            head.combine(full[None, : p + 1, :W]),
            cache,
            torch.zeros(1, dtype=torch.long),
        )
        step_logits, c, pos = logits[:, -1], carry[:, -1:], torch.tensor([p + 1])
        for k in range(3):
            assert torch.allclose(step_logits[0], captured[k][0, p], atol=1e-4), f"step {k + 1} differs"
            token = head.to_target_ids(step_logits.argmax(-1))
            step_logits, c = head.step(token[:, None], c, cache, pos)
            step_logits, pos = step_logits[:, 0], pos + 1


def test_ttt_loss_falls_when_training_on_tiny_data(target):
    torch.manual_seed(0)
    seqs = [torch.randint(0, 64, (24,)) for _ in range(4)]
    head = new_eagle3_head(target, seed=2).float()
    layers = (*head.hidden_layers, target.config.num_layers)
    W = len(head.hidden_layers) * target.config.hidden_size
    st = [states(target, s.tolist(), layers) for s in seqs]
    data = TeacherData(torch.cat(seqs), torch.cat(st), [0, 24, 48, 72, 96], layers, "x")
    batch = {
        "tokens": torch.stack(seqs),
        "aux": torch.stack(st)[..., :W],
        "final": torch.stack(st)[..., W:],
        "lengths": torch.tensor([24] * 4),
    }
    vocab = torch.arange(64)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = ttt_loss(head, batch, vocab, target.lm_head.weight, TrainSettings(ttt_steps=2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert data.rows() == 4
    assert losses[-1] < 0.5 * losses[0]
    assert not target.embed_tokens.weight.requires_grad  # the target's shared weights stay frozen


@pytest.mark.parametrize("mechanism", ["dflash", "dspark"])
def test_anchored_block_training_computes_what_drafting_computes(target, mechanism):
    """Every anchored block of the training pass (all anchors of a sequence at once, masked) holds the states the
    drafter computes for that block when the sequence ends at its anchor; the loss then falls on tiny data."""
    from specdec_tune.profiles.train_drafter import block_loss

    head = HEADS[mechanism](target)
    seq = [5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 1, 4, 4, 2]
    layers = head.hidden_layers
    full = states(target, seq, (*layers, target.config.num_layers))
    W = len(layers) * target.config.hidden_size
    captured, rope_calls = [], []
    original, original_rope = head.block_hidden, head.rope

    def spy(tokens, cos, sin, context, mask):
        out = original(tokens, cos, sin, context, mask)
        captured.append((rope_calls[-1], out))
        return out

    def rope_spy(positions):
        rope_calls.append(positions)
        return original_rope(positions)

    head.block_hidden, head.rope = spy, rope_spy
    vocab = head.to_target_ids(torch.arange(head.draft_vocab_size))
    batch = {
        "tokens": torch.tensor([seq]),
        "aux": full[None, :, :W],
        "final": full[None, :, W:],
        "lengths": torch.tensor([len(seq)]),
    }
    with torch.no_grad():
        block_loss(
            head,
            batch,
            vocab,
            target.lm_head.weight[vocab],
            TrainSettings(mechanism=mechanism),
            torch.Generator().manual_seed(0),
        )
    positions, trained = captured.pop()
    bs = head.block_size
    anchors = positions[0, ::bs].tolist()
    assert len(anchors) == len(seq) // bs and all(1 <= a <= len(seq) - 2 for a in anchors)
    for i, a in enumerate(anchors):
        drafter = DRAFTERS[mechanism].from_head(head)
        drafter.start([seq[: a + 1]])
        drafter.propose(
            DraftRequest([seq[: a + 1]], [drafter.max_draft_len], 0.0, hidden_states=full[None, :a, :W], num_hidden=[a])
        )
        _, drafted = captured.pop()
        assert torch.allclose(drafted[0], trained[0, i * bs : (i + 1) * bs], atol=1e-4), (
            f"the block at anchor {a} differs"
        )
    del head.block_hidden, head.rope

    params = [
        p.requires_grad_(True) for n, p in head.named_parameters() if not n.startswith("embed_tokens")
    ]  # the target's stays frozen
    opt = torch.optim.AdamW(params, lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(30):
        loss, agree = block_loss(
            head, batch, vocab, target.lm_head.weight[vocab].detach(), TrainSettings(mechanism=mechanism), g
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert len(agree) == head.max_drafts and losses[-1] < 0.5 * losses[0]
    assert not target.embed_tokens.weight.requires_grad


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_saved_head_loads_back_and_drafts_the_same(tmp_path, target, mechanism):
    head = HEADS[mechanism](target)
    folder = save_head(
        head,
        mechanism,
        tmp_path / mechanism,
        verifier="tiny",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
        extra={"x": 1},
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == mechanism
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["transformer_layer_config"]["hidden_size"] == target.config.hidden_size
    if mechanism == "eagle3":
        assert config["draft_vocab_size"] == 22 and config["eagle_aux_hidden_state_layer_ids"] == list(
            head.hidden_layers
        )
    elif mechanism == "mtp":
        assert config["num_nextn_predict_layers"] == 1
    else:
        assert config["block_size"] == head.block_size and config["aux_hidden_state_layer_ids"] == list(
            head.hidden_layers
        )
        assert config["mask_token_id"] == head.mask_token_id and config["sample_from_anchor"] == (mechanism == "dspark")
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        if mechanism == "dspark":
            assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"]) == (
                8,
                "rnn",
                True,
            )
    back = load_head(folder, loaded(target), expect=mechanism)
    assert back.format == "speculators" and len(back.weights_hash) == 64
    plain = generate(target, PROMPTS, max_new_tokens=16).tokens
    a = generate(target, PROMPTS, drafter=DRAFTERS[mechanism].from_head(head), num_draft_tokens=3, max_new_tokens=16)
    b = generate(
        target,
        PROMPTS,
        drafter=DRAFTERS[mechanism](loaded(target), DRAFTERS[mechanism].Options(model=str(folder))),
        num_draft_tokens=3,
        max_new_tokens=16,
    )
    assert a.tokens == b.tokens == plain
    assert [c.num_accepted_tokens for c in a.per_prompt] == [c.num_accepted_tokens for c in b.per_prompt]
    if mechanism == "mtp":  # the target's embedding and head are shared, not stored
        assert back.head.lm_head is target.lm_head


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_a_head_for_a_non_llama_target_is_written_with_the_llama_layer_it_runs(tmp_path, family):
    """The head's layer is a llama decoder layer whatever the target's family (no biases, no q/k norm); its config
    says llama, the layer type vLLM 0.32's EAGLE-3 reader builds (it refuses qwen2, mistral, gemma, ...), and the
    export takes it."""
    from specdec_tune.exporters.bundle import head_config_fields

    base = tiny_model(vocab=64, layers=6, seed=3)
    c = dataclasses.replace(base.config, model_type=family, attention_bias=family == "qwen2", qk_norm=family == "qwen3")
    torch.manual_seed(4)
    target = init_random(CausalLM(c), seed=4).eval().requires_grad_(False)
    for mechanism in ("eagle3", "mtp"):
        folder = save_head(
            HEADS[mechanism](target),
            mechanism,
            tmp_path / mechanism,
            verifier="tiny",
            verifier_architectures=["X"],
            speculative_tokens=3,
        )
        config = json.loads((folder / "config.json").read_text())
        assert config["transformer_layer_config"]["model_type"] == "llama"
        head_config_fields(mechanism, {"model": str(folder)})
        drafter = DRAFTERS[mechanism](loaded(target), DRAFTERS[mechanism].Options(model=str(folder)))
        out = generate(target, PROMPTS, drafter=drafter, num_draft_tokens=3, max_new_tokens=8)
        assert out.tokens == generate(target, PROMPTS, max_new_tokens=8).tokens


def _eagle3_folder(tmp_path, target, edit_config=None, edit_state=None) -> Path:
    folder = save_head(
        HEADS["eagle3"](target),
        "eagle3",
        tmp_path / "h",
        verifier="tiny",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
    )
    if edit_config:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda c: c.update(target_hidden_size=48),
            "reads target states of width 48, but the target's hidden size is 32",
        ),
        (lambda c: c["transformer_layer_config"].update(vocab_size=100), "100-token vocabulary, the target 64"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3, 7]), r"\[7\] do not exist in the 6-layer target"),
        (lambda c: c.update(draft_vocab_size=30), "does not map 30 draft ids"),
        (lambda c: c.update(speculators_model_type="peagle"), "speculators 'peagle' checkpoint"),
        (lambda c: c.update(auto_map={"AutoModel": "x.Y"}), "custom model code"),
    ],
    ids=["hidden", "vocab", "layer-ids", "d2t", "unsupported", "auto-map"],
)
def test_a_head_for_another_verifier_is_refused(tmp_path, target, edit, match):
    folder = _eagle3_folder(tmp_path, target, edit_config=edit)
    with pytest.raises(SpecdecError, match=match):
        load_head(folder, loaded(target))


def test_mismatches_name_the_fix_and_pickles_are_refused(tmp_path, target):
    other = tiny_model(vocab=64, layers=6, seed=4)
    folder = _eagle3_folder(tmp_path, target)
    with pytest.raises(SpecdecError, match="holds a eagle3 head, not mtp"):
        load_head(folder, loaded(target), expect="mtp")
    load_head(folder, loaded(other))  # same shapes, other weights: loads (the verifier's identity is in its config)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(SpecdecError, match="pickle"):
        load_head(pickled, loaded(target))


def test_model_optimizer_eagle3_export_loads(tmp_path, target):
    head = HEADS["eagle3"](target)
    c = target.config
    folder = tmp_path / "modelopt"
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "draft_vocab_size": head.draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(head.hidden_layers), "use_aux_hidden_state": True},
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = {
        k.replace("layers.0.", "midlayer."): v.contiguous()
        for k, v in head.state_dict().items()
        if k != "embed_tokens.weight"
    }
    save_file(state, str(folder / "model.safetensors"))
    back = load_head(folder, loaded(target))
    assert back.format == "modelopt" and back.mechanism == "eagle3"
    for k, v in head.state_dict().items():
        assert torch.equal(back.head.state_dict()[k], v), k
    config["eagle_config"]["use_aux_hidden_state"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match="EAGLE-1"):
        load_head(folder, loaded(target))


def test_zlab_dflash_layout_loads_with_its_layer_offset(tmp_path, target):
    """z-lab's DFlashDraftModel folder: flat Qwen3 config, `dflash_config` with decoder-layer ids (state after layer t,
    the state entering layer t+1 here), the target's LM head. It drafts exactly as the head it was written from."""
    head = new_dflash_head(target, block_size=4, seed=2)
    head.lm_head = target.lm_head  # z-lab drafts with the target's head
    state = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed_tokens", "lm_head", "d2t"))}
    c = head.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": 512,
        "num_target_layers": 6,
        "block_size": 4,
        "dflash_config": {"mask_token_id": head.mask_token_id, "target_layer_ids": [i - 1 for i in head.hidden_layers]},
    }
    tmp_path.joinpath("z").mkdir()
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "z" / "model.safetensors"))
    back = load_head(tmp_path / "z", loaded(target), expect="dflash")
    assert (
        back.format == "z-lab" and back.head.hidden_layers == head.hidden_layers and back.head.lm_head is target.lm_head
    )
    a = generate(target, PROMPTS, drafter=DFlashDrafter.from_head(head), num_draft_tokens=3, max_new_tokens=16)
    b = generate(target, PROMPTS, drafter=DFlashDrafter.from_head(back.head), num_draft_tokens=3, max_new_tokens=16)
    assert a.tokens == b.tokens and [c.rounds for c in a.per_prompt] == [c.rounds for c in b.per_prompt]
    config["dflash_config"]["mask_token_id"] = 64
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match="mask_token_id 64"):
        load_head(tmp_path / "z", loaded(target))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(block_size=1), "block_size 1"),
        (lambda c: c.update(markov_head_type="lstm"), "markov_head_type 'lstm'"),
        (lambda c: c.update(aux_hidden_state_layer_ids=[1, 9]), r"\[9\] do not exist"),
        (lambda c: c.update(markov_rank=4), "the config implies"),
    ],
)
def test_a_mismatched_dspark_head_is_refused(tmp_path, target, edit, match):
    folder = save_head(
        HEADS["dspark"](target),
        "dspark",
        tmp_path / "d",
        verifier="tiny",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=4,
    )
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match=match):
        load_head(folder, loaded(target))


# ---------------------------------------------------------------------------- profiling and the command line


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_head_drafters_profile_like_the_others(mechanism):
    from specdec_tune.profiles.torch_profile import TorchProfiler
    from specdec_tune.settings import ProfileSettings

    target = tiny_model(vocab=1024)  # the draft-cost cell appends token ids below 1000
    profiler = TorchProfiler.__new__(TorchProfiler)
    profiler.s = ProfileSettings(max_draft_len=4, drafters=(mechanism,), quant_formats=("fp8",))
    profiler.model, profiler.device = target, torch.device("cpu")
    profiler.prompt_ids = [[1, 2, 3, 4, 5, 6, 7, 8]]
    drafter = DRAFTERS[mechanism](loaded(target), DRAFTERS[mechanism].Options(random=True))
    profiler.drafters = {mechanism: drafter}
    timings = profiler._draft_cell(drafter, 2, 16)
    assert set(timings) >= {1, 2, 4} and all(t["median_ms"] > 0 for t in timings.values())
    info = profiler._drafter_infos()[0]
    assert info["kind"] == ("parallel" if mechanism in ("dflash", "dspark") else "serial")
    assert info["quant_formats"] == ["none", "fp8"] and info["draft_len_multiple"] == 1
    assert info["max_draft_len"] == (7 if mechanism == "dflash" else 8 if mechanism == "dspark" else None)
    assert info["model"]["hidden_layers"] == list(drafter.hidden_layers)
    quantized = drafter.with_quantized_weights("fp8")
    assert (
        generate(target, PROMPTS, drafter=quantized, num_draft_tokens=2, max_new_tokens=8).tokens
        == generate(target, PROMPTS, max_new_tokens=8).tokens
    )


def test_train_drafter_rejects_an_unknown_mechanism(capsys):
    assert main(["train-drafter", "--mechanism", "medusa"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "pass --mechanism" in err[0]
        and all(m in err[0] for m in ("eagle3", "mtp", "dflash", "dspark"))
    )


# ---------------------------------------------------------------------------- the demo target


@pytest.mark.demo
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_trainer_output_loads_through_the_speculators_loader(tmp_path, mechanism):
    """A short real run on the demo target (4 training prompts, seconds of optimisation, one AL measurement on two
    held-back prompts): the folder it writes is a speculators checkpoint that the loader accepts for this target and
    that drafts losslessly."""
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.train_drafter import train

    settings = TrainSettings(
        mechanism=mechanism,
        max_prompts=4,
        new_tokens=16,
        package_tokens=1024,
        budget_minutes=0.1,
        eval_points=1,
        eval_prompts=2,
        eval_new_tokens=8,
        draft_vocab=2048,
        batch_tokens=512,
        out=tmp_path / mechanism,
    )
    record = train(settings)
    assert record["data"]["split"] == "profile" and record["train"]["steps"] > 0
    point = record["learning_curve"][0]
    D = 7 if mechanism in ("dflash", "dspark") else 3
    assert point["draft_len"] == D and len(point["per_position_acceptance"]) == D and point["prompts"] == 2
    assert sum(r["prompts"] for r in point["by_domain"].values()) == 2
    target = load_model(dtype="float32")
    back = load_head(record["folder"], target, expect=mechanism)
    assert back.format == "speculators"
    config = json.loads((Path(record["folder"]) / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    ids = [target.tokenizer.encode("Write a haiku about the sea.")]
    drafter = DRAFTERS[mechanism](target, DRAFTERS[mechanism].Options(model=record["folder"]))
    out = generate(target.model, ids, drafter=drafter, num_draft_tokens=3, max_new_tokens=16)
    assert out.tokens == generate(target.model, ids, max_new_tokens=16).tokens


@pytest.mark.demo
def test_package_text_is_windows_of_installed_prose_and_code():
    """The package-text part of the training data: deterministic, windows no longer than asked, both kinds present."""
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.package_text import package_text, text_files

    files = text_files()
    assert files["prose"] and files["code"]
    tok = load_model(dtype="float32").tokenizer
    first = package_text(tok, 6000, chunk_tokens=256)
    assert first == package_text(tok, 6000, chunk_tokens=256)
    assert all(64 <= len(w) <= 256 for w in first)
    assert 6000 <= sum(map(len, first)) <= 6000 + 2 * 256
    assert any("def " in tok.decode(w) for w in first)  # the code share
