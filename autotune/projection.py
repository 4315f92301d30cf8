"""Planning for a device you do not have: project a measured profile onto a hardware-table entry.

Acceptance does not depend on the device and is kept as measured. Every time is replaced by a
roofline model of the same step on the other device, and labelled `modeled`:

    T_step(B, T, ctx) = max(FLOPs / peak_bf16, bytes / bandwidth) + kernels x launch_s
    FLOPs  = 2 * params_read * B*T  +  layers * 4 * B*T' * ctx * H*hd      (GEMMs + attention)
    T'     = ceil(G*T / tile) * tile / G                                     (query rows padded to the tile)
    bytes  = 2 * params_read  +  layers * B * (ctx+T) * 2 * H_kv*hd * 2    (bf16 weights + KV cache)

The model's shapes come from the profile's linear micro-curve (the target's real layer shapes).
Drafters with a network, by their `kind` and `model` record in the profile:

    serial    (draft model, EAGLE-3, MTP)  T_draft = D x T_step(B, 1, ctx)           over its own layers
    parallel  (DFlash, DSpark)             T_draft = T_step(B, block, ctx), flat in D  one pass over the block
    block     = the head's longest draft + 1 (the anchor): DFlash's block; one row more than DSpark's, whose
                anchor slot drafts too
    LM head   = hidden x V rows read per step: V = the head's `draft_vocab_size` (EAGLE-3, DFlash and DSpark
                heads draft over a reduced vocabulary), the target's vocabulary for a draft model, MTP, and
                profiles that do not record it (said in the notes)

A head's layers are costed at the target's layer shapes; the fc that fuses the target's states (once per
round) and DSpark's rank-r Markov steps are left out. Lookups stay at their measured host time (they run on
the host CPU) but are labelled modeled, as is the host overhead. A mixture-of-experts target is refused: how many
experts a step wakes is measured (profile.moe), not modeled, so its curve is only known where it was profiled.
"""

from __future__ import annotations

import dataclasses
import math

from specdec_tune import SpecdecError
from specdec_tune.autotune.hardware import DeviceSpec, roofline_ms
from specdec_tune.formats import FORMATS
from specdec_tune.profiles.schema import DrafterInfo, Profile

LAUNCH_S = 4e-6  # per kernel under CUDA-graph replay (an assumption, not a datasheet figure)
KERNELS_PER_LAYER = 10  # norms, fused qkv, rope, cache write, attention, o, norm, gate_up, act, down
GPU_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROJECTED_DTYPE_BYTES = 2  # bf16: the dtype the roofline model reads weights and KV in


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: int
    layer_params: int  # per decoder layer, linear weights only
    head_params: int  # hidden x vocab: the target's LM head
    q_width: int  # H * hd
    kv_width: int  # H_kv * hd
    hidden: int = 0  # the LM head's input width
    vocab: int = 0  # the target's vocabulary (the LM head's rows)

    @property
    def group(self) -> int:  # G, query heads per KV head
        return max(1, self.q_width // self.kv_width)


def shapes_from_profile(profile: Profile) -> Shapes:
    linear = {p.layer: (p.in_features, p.out_features) for p in profile.micro if p.kind == "linear"}
    if not {"qkv", "o", "gate_up", "down", "lm_head"} <= set(linear):
        raise SpecdecError(
            "the profile has no layer shapes (linear micro-curve)",
            "re-run `specdec-tune profile` without skipping its micro phase",
        )
    q_width = linear["o"][0]
    hidden, vocab = linear["lm_head"]
    return Shapes(
        layers=int(profile.target["num_layers"]),
        layer_params=sum(i * o for name, (i, o) in linear.items() if name != "lm_head"),
        head_params=hidden * vocab,
        q_width=q_width,
        kv_width=(linear["qkv"][1] - q_width) // 2,
        hidden=hidden,
        vocab=vocab,
    )


# bytes per weight, scales included, on a 4096 x 4096 layer: bf16 2; e4m3 + row scales 1 + 4/4096;
# e2m1 + block scales 0.5625
WEIGHT_BYTES = {name: f.bits_per_weight((4096, 4096)) / 8 for name, f in FORMATS.items()}


def step_ms(
    spec: DeviceSpec,
    s: Shapes,
    layers: int,
    batch: int,
    tokens: int,
    ctx: int,
    quant: str = "none",
    head_params: int | None = None,
) -> float:
    """One forward of `layers` layers and an LM head of `head_params` weights (default: the target's) over
    batch x tokens rows, each attending to ctx cached positions."""
    rows = batch * tokens
    params = layers * s.layer_params + (s.head_params if head_params is None else head_params)
    padded_tokens = math.ceil(s.group * tokens / spec.attention_tile_rows) * spec.attention_tile_rows / s.group
    flops = 2 * params * rows + layers * 4 * batch * padded_tokens * ctx * s.q_width
    kv_bytes = layers * batch * (ctx + tokens) * 2 * s.kv_width * 2
    launches = layers * KERNELS_PER_LAYER + 4
    return (
        roofline_ms(spec, flops, WEIGHT_BYTES[quant] * params + kv_bytes, FORMATS[quant].compute_dtype)
        + 1e3 * launches * LAUNCH_S
    )


def is_learned_head(info: DrafterInfo) -> bool:
    """A head over the target's hidden states (EAGLE-3, MTP, DFlash, DSpark), not a draft model or a lookup."""
    return "hidden_layers" in (info.model or {})


def draft_head_params(s: Shapes, info: DrafterInfo) -> int:
    """hidden x V: the LM head a drafter reads per step. V is a learned head's draft vocabulary where the profile
    records it, else the target's vocabulary (a draft model shares the target's; older profiles lack the key)."""
    vocab = (info.model or {}).get("draft_vocab_size") if is_learned_head(info) else None
    return s.head_params if vocab is None else s.hidden * int(vocab)


def block_tokens(info: DrafterInfo, workload_max_draft_len: int) -> int:
    """Rows per sequence of a parallel drafter's one pass: its longest draft and the anchor."""
    return (info.max_draft_len or workload_max_draft_len) + 1


def draft_step_ms(
    spec: DeviceSpec,
    s: Shapes,
    info: DrafterInfo,
    batch: int,
    draft_len: int,
    ctx: int,
    quant: str,
    workload_max_draft_len: int,
) -> float:
    """T_draft(B, D) of a drafter with a network of its own, per the module docstring."""
    assert info.model is not None, "only a drafter with a network of its own (and so its model record) drafts in steps"
    layers, head = int(info.model["layers"]), draft_head_params(s, info)
    if info.kind == "parallel":  # one pass over the whole block, whatever D is
        return step_ms(spec, s, layers, batch, block_tokens(info, workload_max_draft_len), ctx, quant, head)
    return draft_len * step_ms(spec, s, layers, batch, 1, ctx, quant, head)  # one catch-up + D-1 drafting steps


def project(profile: Profile, spec: DeviceSpec) -> Profile:
    """The profile as the device `spec` would have measured it, per the model above (times: modeled)."""
    if profile.rounds:
        raise SpecdecError(
            f"this profile was measured in {profile.backend}: its times are whole engine rounds, which the roofline "
            "model does not take apart",
            "profile in the engine on that device, or project a profile of --engine torch",
        )
    if profile.moe:
        raise SpecdecError(
            f"the target is a mixture of experts ({profile.moe['num_experts']} per layer): the roofline model reads "
            "one dense MLP per layer, while a verify step's cost follows the experts its tokens wake (measured only "
            "on this device)",
            "profile the target on that device",
        )
    s = shapes_from_profile(profile)
    w = profile.workload
    buckets = GPU_BATCH_BUCKETS if spec.capability is not None or spec.gfx else tuple(w.batch_buckets)
    verify = [
        {"batch": B, "tokens": t, "ctx": ctx, "median_ms": step_ms(spec, s, s.layers, B, t, ctx), "source": "modeled"}
        for ctx in w.ctx_buckets
        for B in buckets
        for t in range(1, w.max_draft_len + 2)
    ]
    drafters = {d.name: d for d in profile.drafters}
    draft = []
    for p in profile.draft:
        if p.batch != w.batch_buckets[0] or p.quant != "none":
            continue
        info = drafters[p.mechanism]
        layers = (info.model or {}).get("layers")
        for quant in [q for q in info.quant_formats if q in spec.formats] if layers else ["none"]:
            for b in buckets:
                if layers:  # model steps on the device: D serial steps, or one pass over a block
                    ms = draft_step_ms(spec, s, info, b, p.draft_len, p.ctx, quant, w.max_draft_len)
                else:  # host-side lookups: linear in the rows, from the measured per-row time
                    ms = (p.median_ms or 0.0) * b / p.batch
                draft.append(
                    {
                        "mechanism": p.mechanism,
                        "quant": quant,
                        "batch": b,
                        "draft_len": p.draft_len,
                        "ctx": p.ctx,
                        "median_ms": ms,
                        "source": "modeled",
                    }
                )
    host_by_mech: dict[str, list] = {}
    for h in profile.host:
        host_by_mech.setdefault(h.mechanism, []).append(h)
    host = []
    for mech, points in host_by_mech.items():
        per_row = max(h.host_ms_per_round / h.batch for h in points)  # bookkeeping scales with rows
        for b in buckets:
            host.append(
                {
                    "mechanism": mech,
                    "batch": b,
                    "draft_len": points[0].draft_len,
                    "host_ms_per_round": per_row * b,
                    "round_ms": 0.0,
                    "rounds": 0,
                    "source": "modeled",
                }
            )
    data = profile.model_dump(mode="json")
    data.update(
        verify=verify,
        draft=draft,
        host=host,
        device={**spec.as_record(), "kind": "cuda", "projected_from": profile.device.get("name")},
        memory=projected_memory(profile.memory, spec),
        workload={**data["workload"], "batch_buckets": list(buckets)},
        notes=[
            *profile.notes,
            f"projected onto {spec.name}: every time is modeled from the hardware table "
            f"(acceptance measured on {profile.device.get('name')})",
            *_vocabulary_notes(profile),
        ],
        timing_shapes=f"{profile.timing_shapes}; times projected by a roofline model",
    )
    return Profile.model_validate(data)


def projected_memory(record: dict, spec: DeviceSpec) -> dict:
    """The memory record on the device `spec`: weights, KV and activations in bf16, the device's memory from the table,
    no engine KV pool and no measured activation (autotune/memory.py)."""
    if not record:
        return {}
    ratio = PROJECTED_DTYPE_BYTES / record["dtype_bytes"]
    return record | {
        "dtype": "bfloat16",
        "dtype_bytes": PROJECTED_DTYPE_BYTES,
        "target": record["target"] | {"kv_bytes_per_token": int(record["target"]["kv_bytes_per_token"] * ratio)},
        "drafters": {
            name: d | {"kv_bytes_per_token": int(d["kv_bytes_per_token"] * ratio)}
            for name, d in record["drafters"].items()
        },
        "activation_bytes_per_row": int(record["activation_bytes_per_row"] * ratio),
        "activation": [
            a
            | {"bytes": int(a["batch"] * a["tokens"] * record["activation_bytes_per_row"] * ratio), "source": "modeled"}
            for a in record["activation"]
        ],
        "device": {
            "usable_bytes": spec.memory_bytes,
            "kv_cache_bytes": None,
            "source": f"the hardware table: {spec.name}",
        },
    }


def _vocabulary_notes(profile: Profile) -> list[str]:
    """A note naming the learned heads whose draft vocabulary the profile does not record (profiled before it was)."""
    missing = sorted(
        d.name for d in profile.drafters if is_learned_head(d) and "draft_vocab_size" not in (d.model or {})
    )
    if not missing:
        return []
    return [
        f"{', '.join(missing)}: the profile records no draft vocabulary, so the projection charges the target's "
        "vocabulary for the head's LM head (an overestimate for a reduced draft vocabulary); re-profile to record it"
    ]
