"""Every command's settings and their defaults, written once: the stages run on them, the CLI's options show them.

Torch-free (the CLI reads the defaults before any stage loads). A check that needs a stage's registries (a drafter
or head mechanism that exists) is made by that stage when it starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.formats import WEIGHT_FORMATS

SPLITS = ("profile", "held_back", "all")  # of a calibration set
OBJECTIVES = ("speedup", "throughput", "per-user", "pareto")  # search --objective (autotune/space.py)
MEASUREMENT_BACKENDS = (
    "torch",
    "vllm",
)  # profile --engine: the registry in profiles/backends.py, named here torch-free
# The default grid per device kind: (largest batch bucket, D_max). A 2-core CPU decodes the demo target at about
# 15 tokens/s per row at batch 1 and saturates its compute by batch 8, where a GPU's verify step stays flat to
# batch 64 and beyond; its profile must also fit in minutes. --batch and --max-draft-len override either.
DEFAULT_GRID = {"cpu": (8, 7), "cuda": (256, 15)}
DSPARK_DEMO_RANK = 64  # the demo DSpark's Markov rank (speculators' default, 256, would outgrow the demo backbone)


# ---------------------------------------------------------------------------- profile, decode, train-drafter


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    target: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ngram", "suffix", "draft_model")  # "name" or "name:key=value,key=value"
    prompts: str = "default"
    prompts_per_domain: int = (
        3  # to start with: more are added (7 per MT-Bench category in the profiling split) until the interval is tight
    )
    acceptance_half_width: float = 0.02  # target relative half-width (95%) of tokens per forward at the relevant D
    second_turns: bool = False  # growth goes on with MT-Bench's second turns (profiles/second_turns.py)
    acceptance: str = "replay"  # greedy acceptance: "replay" where the drafter allows it, or "loop" for every drafter
    sampled_prompts_per_domain: int = (
        1  # prompts per domain for temperatures > 0 (the loop, at D_max: the costliest unit)
    )
    check_prompts: int = (
        4  # prompts on which the loop checks the replay (dealt over the checked D: two each by default)
    )
    new_tokens: int = (
        32  # per prompt: for a fixed cost, more prompts narrow the interval over prompts more than longer ones
    )
    temperatures: tuple[float, ...] = (0.0, 0.7)
    batch_buckets: tuple[int, ...] = ()  # () = the device's grid: DEFAULT_GRID
    ctx_buckets: tuple[int, ...] = (128, 512)
    max_draft_len: int | None = None  # None = the device's grid: DEFAULT_GRID
    check_draft_lens: tuple[int, ...] = ()  # direct runs to check derived AL against; () = D_max/4 and D_max/2
    acceptance_batch: int = 16  # prompts the loop decodes together (temperatures > 0, --acceptance loop, the check)
    quant_formats: tuple[str, ...] = tuple(f for f in WEIGHT_FORMATS if f != "none")  # every quantized format
    interp_tolerance: float = 0.03  # bisect the verify curve where interpolation misses by more
    verify_visits: int = 6  # most visits per verify cell while its median's interval is wider than the target
    dtype: str = "auto"
    device: str = "auto"
    out_dir: Path = Path("artifacts/profile")
    budget_minutes: float = 3.5  # acceptance growth, then the decision cells' verify refinement, fill what is left
    seed: int = 0
    force: bool = False
    trust_remote_code: bool = False
    engine: str = "torch"  # the measurement backend: "torch" (this package's loop) or "vllm" (the serving engine)
    engine_options: tuple[tuple[str, object], ...] = ()  # passed to the engine as they are (vLLM: EngineArgs fields)

    @property
    def checks(self) -> tuple[int, ...]:
        if self.check_draft_lens:
            return self.check_draft_lens
        D = self.max_draft_len
        assert D is not None, "the checked draft lengths are read after for_device() filled in D_max"
        return tuple(sorted({max(1, D // 4), max(1, D // 2)} - {D}))

    def for_device(self, kind: str) -> ProfileSettings:
        """These settings with the device's default grid filled in where none was given (`DEFAULT_GRID`)."""
        largest_batch, d_max = DEFAULT_GRID["cuda" if kind == "cuda" else "cpu"]
        return dataclasses.replace(
            self,
            batch_buckets=self.batch_buckets or tuple(2**i for i in range(largest_batch.bit_length())),
            max_draft_len=self.max_draft_len or d_max,
        )

    def validate(self) -> None:
        if self.max_draft_len is not None and self.max_draft_len < 1:
            raise SpecdecError(
                f"--max-draft-len {self.max_draft_len} must be at least 1",
                f"use 1 or more (default {DEFAULT_GRID['cpu'][1]} on CPU, {DEFAULT_GRID['cuda'][1]} on a GPU)",
            )
        for name, values in (("--batch", self.batch_buckets or (1,)), ("--ctx", self.ctx_buckets)):
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise SpecdecError(
                    f"{name} buckets {list(values)} must be distinct increasing positive integers",
                    f"e.g. {name} 1,2,4,8",
                )
        if self.max_draft_len and any(not 0 < d < self.max_draft_len for d in self.check_draft_lens):
            raise SpecdecError(
                f"check draft lengths {list(self.check_draft_lens)} must lie in 1..{self.max_draft_len - 1}",
                "pick smaller D than --max-draft-len",
            )
        if self.prompts_per_domain < 1 or self.new_tokens < 2 or self.budget_minutes <= 0:
            raise SpecdecError(
                "--prompts-per-domain, --new-tokens and --budget-minutes must be positive (new tokens ≥ 2)",
                "raise them",
            )
        if any(t < 0 for t in self.temperatures):
            raise SpecdecError(f"temperatures {list(self.temperatures)} must be ≥ 0", "use 0 for greedy")
        if self.verify_visits < 1:
            raise SpecdecError(f"--verify-visits {self.verify_visits} must be at least 1", "use 1 or more (default 6)")
        if self.acceptance not in ("replay", "loop"):
            raise SpecdecError(f"--acceptance {self.acceptance!r} is not a method", "use replay (default) or loop")
        if not 0 <= self.acceptance_half_width < 1:
            raise SpecdecError(
                f"--half-width {self.acceptance_half_width:g} is not a fraction",
                "use e.g. 0.02 for ±2% (0: no prompts added)",
            )
        if self.engine not in MEASUREMENT_BACKENDS:
            raise SpecdecError(
                f"--engine {self.engine!r} is not a measurement backend",
                f"use one of: {', '.join(MEASUREMENT_BACKENDS)}",
            )
        if self.engine_options and self.engine == "torch":
            raise SpecdecError(
                "--engine-option is passed to a serving engine; the torch backend takes none",
                "add --engine vllm, or drop it",
            )


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    target: str = "smollm2-135m"
    drafter: str | None = None
    drafter_options: dict[str, str] = dataclasses.field(default_factory=dict)
    num_draft_tokens: int = 3
    prompts: str = "default"
    split: str = "held_back"
    num_prompts: int = 16
    batch_size: int = 1
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    check_lossless: bool = False
    trust_remote_code: bool = False

    def validate(self) -> None:
        if self.split not in SPLITS:
            raise SpecdecError(f"unknown split {self.split!r}", f"use one of: {', '.join(SPLITS)}")
        if self.drafter is not None and self.num_draft_tokens < 1:
            raise SpecdecError(f"draft length D = {self.num_draft_tokens} is invalid", "use -D 1 or more")
        for name, value in (
            ("--batch-size", self.batch_size),
            ("--num-prompts", self.num_prompts),
            ("--max-new-tokens", self.max_new_tokens),
        ):
            if value < 1:
                raise SpecdecError(f"{name} {value} must be at least 1", f"pass {name} 1 or more")
        if self.check_lossless and self.temperature > 0:
            raise SpecdecError(
                "--check-lossless compares greedy outputs token for token", "drop --temperature or --check-lossless"
            )
        if self.check_lossless and self.drafter is None:
            raise SpecdecError(
                "--check-lossless needs a drafter: without one it compares plain decoding with plain decoding",
                "add --drafter ngram (or another drafter)",
            )


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    mechanism: str = "eagle3"
    target: str = "smollm2-135m"
    prompts: str = "default"  # calibration set; only its profiling split is read
    max_prompts: int = 0  # 0 = the whole profiling split
    new_tokens: int = 192  # the target's greedy continuation per prompt
    package_tokens: int = 600_000  # text from the installed packages, teacher-forced (0 = continuations only)
    draft_vocab: int = (
        8192  # most frequent tokens: EAGLE-3's draft vocabulary, MTP's loss shortlist; 0 = the full vocabulary
    )
    ttt_steps: int = 3  # unrolled draft steps per position (EAGLE-3, MTP)
    step_decay: float = 0.8  # loss weight of step k: decay^(k-1)
    block_size: int = 8  # DFlash / DSpark: tokens per block (DFlash drafts block_size-1, DSpark block_size)
    draft_layers: int = 2  # DFlash / DSpark decoder layers
    markov_rank: int = DSPARK_DEMO_RANK  # DSpark's Markov bias rank
    position_decay: float = 4.0  # DFlash / DSpark: slot j's loss weight exp(-j / position_decay)
    lr: float = 1e-3
    batch_tokens: int = 2048  # padded tokens per optimizer step
    budget_minutes: float = 20.0  # optimisation wall time (data preparation and AL measurements are reported apart)
    eval_points: int = 4  # AL measurements along the run (the learning curve); 0 = none
    eval_prompts: int = 20  # held-back MT-Bench prompts per measurement (20 of the 24, every domain)
    eval_new_tokens: int = 64
    seed: int = 0
    out: Path | None = None  # None = this target's cached demo head (what --drafter eagle3 / mtp loads)

    def validate(self) -> None:
        if (
            self.budget_minutes <= 0
            or self.new_tokens < 8
            or self.package_tokens < 0
            or self.ttt_steps < 1
            or self.batch_tokens < 64
            or self.lr <= 0
        ):
            raise SpecdecError(
                "--budget-minutes, --lr must be positive, --package-tokens ≥ 0, --new-tokens ≥ 8, --ttt-steps ≥ 1, "
                "--batch-tokens ≥ 64",
                "raise the value named",
            )
        if self.block_size < 2 or self.draft_layers < 1 or self.markov_rank < 1 or self.position_decay <= 0:
            raise SpecdecError(
                "--block-size must be ≥ 2, --draft-layers and --markov-rank ≥ 1", "raise the value named"
            )
        if self.draft_vocab < 0 or self.eval_points < 0 or self.eval_prompts < 1:
            raise SpecdecError("--draft-vocab and --eval-points must be ≥ 0, --eval-prompts ≥ 1", "fix the value named")


# ---------------------------------------------------------------------------- search


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    objective: str = "speedup"  # speedup | throughput | per-user | pareto (space.py)
    trials: int = 0  # 0 = the default for the objective (study.trials_for)
    seed: int = 0
    min_user_tokens_per_s: float = 0.0  # per-user rate floor
    min_tokens_per_s: float = 0.0  # tokens/s-per-device floor (per-user and pareto objectives)
    mechanisms: tuple[str, ...] = ()  # () = every profiled mechanism
    quant_formats: tuple[str, ...] = ("none",)
    tile_rows: int = 0  # attention tile for the tile policy; 0 = the device's
    tie_tolerance: float = 0.005  # a shorter draft is taken over the best where its expected loss is at most this share
    storage: str | None = None  # Optuna storage URL; None = a journal file under out_dir
    study_name: str = ""  # "" = named after the profile and these settings
    out_dir: Path = Path("artifacts")
    device: str | None = None  # plan for this hardware-table device instead of the profiled one (times modeled)
    mix: tuple[tuple[str, float], ...] = ()  # (domain, share of requests); () = the profile's "all" domain
    memory_fraction: float = 0.9  # share of device memory the plan may fill (vLLM's gpu_memory_utilization)
    tensor_parallel: int = 0  # devices one replica spans; 0 = the profile's engine option tensor_parallel_size, else 1


# ---------------------------------------------------------------------------- export, validate


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    prompts: int = 8  # held-back prompts for the lossless gate
    new_tokens: int = 32
    tolerance_pct: float = 15.0
    repeats: int = 3  # timed runs per bucket after one warm-up (median)
    rows: int = 8  # prompts decoded per bucket at least, in batches of the bucket's size
    seed: int = 0
    repair_rounds: int = (
        2  # a failed throughput check: rounds of re-measuring its verify cells and re-planning before refusing
    )
    recheck_s: float = 30.0  # the throughput check's time for measuring open verdicts again, over all buckets


# The K engines run when a user sets none or copies the docs' example: vLLM's n-gram and draft-model examples
# use 5; suffix decoding defaults K to its tree depth (24); EAGLE-3 examples use 3; MTP defaults to its layer count (1).
ENGINE_DEFAULT_DRAFT_LEN = {"ngram": 5, "draft_model": 5, "suffix": 24, "eagle3": 3, "mtp": 1, "dflash": 7, "dspark": 7}


@dataclasses.dataclass(frozen=True)
class RefineSettings:
    """The measured refinement after a search (pipeline/refine.py)."""

    groups: int = 4  # batches of prompts a contender decodes at most (the pruner halves at 2, 4, ...)
    group_prompts: int = 4  # prompts a group decodes at least: at batch B, ceil(group_prompts / B) batches of B
    new_tokens: int = 32
    budget_s: float = 0.0  # 0: a sixth of what measuring every D of every bucket would cost
    storage: str | None = None  # an Optuna storage URL; default: a journal beside plan.json
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    plan: Path = Path("artifacts/plan.json")
    profile: Path = Path("artifacts/profile/profile.json")
    out: Path = Path("artifacts/bundle")
    versions: tuple[tuple[str, str], ...] = ()  # engine -> version overrides
    engine_model: str | None = None  # the target as engines should load it; default: its path (or hub id for the demo)
    measure: MeasureSettings = MeasureSettings()
    skip_measure: bool = False  # configs only: no lossless gate, no throughput check (recorded as skipped)
    onnx_drafter: bool = True  # the drafter's ONNX graph (drafters with a network of their own)
    data_parallel: int = 1  # the serving engines' data-parallel size (vLLM drops a per-batch table above 1)
