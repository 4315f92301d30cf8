"""`specdec-tune train-drafter`: distil an EAGLE-3, MTP, DFlash or DSpark head from the target on CPU, saved in the
speculators layout.

  specdec-tune train-drafter --mechanism eagle3                  # the demo target, 20-minute budget, cached for
  --drafter eagle3 specdec-tune train-drafter --mechanism dflash --budget-minutes 5 --out heads/dflash

Data, two parts (the calibration set's held-back split is never read for training):
  continuations  each profiling-split prompt in the chat template, continued greedily by the target for `new_tokens`
                 tokens: the text the head will be asked to draft
  package text   `package_tokens` tokens of prose and code from the installed packages (profiles/package_text.py),
                 read by the target as is: the breadth the continuations lack
The target runs once over every sequence, recording the states the heads read (EAGLE-3's three auxiliary layers and
the final-normed state; cached on disk in shards, shared by every mechanism). Soft labels are the target's
distributions, recomputed per batch from the final state: p_t = softmax(W_v f_t) over the vocabulary v the head is
trained on (EAGLE-3: its draft vocabulary, the `draft_vocab` most frequent tokens of the data; MTP: the same
shortlist for the loss only, since it drafts with the target's full head).

Loss of the serial heads (EAGLE-3's training-time test, used for EAGLE-3 and MTP): the head unrolls `ttt_steps` steps
at every position at once.
  step 1 at p: h = combine(target states at p), token x_{p+1}             -> predicts x_{p+2}, label p_{p+1}
  step k at p: h = carried state of step k-1 at p, token = its argmax     -> predicts x_{p+k+1}, label p_{p+k}
  step k's query at p sits at position p+k-1 and sees step-1 keys at positions <= p and its own chain (steps 2..k at p),
  exactly what it sees when drafting.
  loss = sum_k decay^(k-1) * mean_p KL(p_label || softmax(logits_k))

Loss of the block heads (DFlash, DSpark; speculators' anchored blocks): per sequence, anchors a drawn from 1..len-2;
each anchor's block [x_a, m, ..., m] sits at positions a.. and sees the context positions < a and its own block only.
  slot j drafts x_{p+1} with p = a + j - first_slot; label p_p; weight exp(-(j - first_slot) / position_decay)
  DSpark's Markov bias reads, as the previous token of slot j > first_slot, the target's greedy token at p - 1: the
  token a draft must have been for slot j to be reached at all.
  loss = sum_j w_j * mean_blocks KL(p_label || softmax(logits_j))

Schedule: AdamW, learning rate warmed up over the first 3% of the wall-clock budget and cosine-decayed to 10% at its
end (the budget, not a step count, bounds the run). The learning curve measures AL at D = 3 on held-back MT-Bench
prompts (D = 3 for the serial heads, D = 7 for the block heads) at `eval_points` moments; that time is outside the
budget and reported apart. The last point adds AL per domain and the per-position acceptance.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec_tune import SpecdecError
from specdec_tune.profiles.calibration import load_calibration, select_prompts
from specdec_tune.profiles.drafters.base import registry
from specdec_tune.profiles.drafters.checkpoints import register_demo_head, save_head
from specdec_tune.profiles.drafters.dflash import DFlashHead, default_mask_token
from specdec_tune.profiles.drafters.heads import DraftHead, DraftVocabulary, default_aux_layers, head_kind, head_kinds
from specdec_tune.profiles.fingerprint import cpu_has_native_bf16
from specdec_tune.profiles.models.folders import architectures, cache_root, model_folder
from specdec_tune.profiles.models.llama import gqa_attention
from specdec_tune.profiles.models.loading import LoadedModel, load_model
from specdec_tune.profiles.package_text import package_text
from specdec_tune.profiles.prompts import encode_prompts
from specdec_tune.profiles.specdec import SpecCounters, generate
from specdec_tune.records import sha256_json, write_json
from specdec_tune.settings import TrainSettings

log = logging.getLogger(__name__)
SHAPE_FIELDS = (
    "ttt_steps",
    "step_decay",
    "block_size",
    "draft_layers",
    "markov_rank",
    "position_decay",
)  # each kind reads some


def head_key(settings: TrainSettings) -> str:
    """What makes one trained head differ from another (not where it goes, not how it is measured)."""
    other = tuple(f for f in SHAPE_FIELDS if f not in head_kind(settings.mechanism).training_fields)
    fields = {
        k: v
        for k, v in dataclasses.asdict(settings).items()
        if k not in ("out", "eval_points", "eval_prompts", "eval_new_tokens", *other)
    }
    return sha256_json(fields)[:12]


def demo_head_folder(settings: TrainSettings, target: LoadedModel) -> Path:
    return cache_root() / "heads" / f"{settings.mechanism}-{target.ref.weights_hash[:12]}-{head_key(settings)}"


def cached_demo_head(mechanism: str, target: LoadedModel) -> Path:
    """This target's default-settings head folder; trained (once, within the default budget) when missing."""
    settings = TrainSettings(mechanism=mechanism, target=target.ref.path)
    folder = demo_head_folder(settings, target)
    if not (folder / "config.json").is_file():
        log.warning(
            "no %s head for this target yet: training one (about %.0f minutes, once; cached in %s)",
            mechanism,
            settings.budget_minutes,
            folder,
        )
        train(settings)
    return folder


# ---------------------------------------------------------------------------- data


@dataclasses.dataclass
class TeacherData:
    """Token sequences and the target's states at `layers` for every position, packed: row i is
    tokens[starts[i]:starts[i+1]]."""

    tokens: torch.Tensor  # [N] int64
    states: torch.Tensor  # [N, len(layers) * hidden] bfloat16
    starts: list[int]
    layers: tuple[int, ...]
    prompts_fingerprint: str

    def rows(self) -> int:
        return len(self.starts) - 1


def teacher_data(settings: TrainSettings, data_target: LoadedModel, progress: Callable[[str], None]) -> TeacherData:
    """The training sequences with the target's states at every position; cached on disk by content, in shards, so a
    stopped preparation resumes. Two parts: the profiling split's prompts continued greedily by the target (the text
    the head drafts at run time) and `package_tokens` of text from the installed packages, read as is."""
    model = data_target.model
    L = model.config.num_layers
    layers = (*default_aux_layers(L), L)  # what both heads read: EAGLE-3's three layers and the final state
    profile_split, _ = load_calibration(settings.prompts).split()  # never the held-back part
    chosen = profile_split.take(settings.max_prompts) if settings.max_prompts else profile_split
    base = {"target": data_target.ref.weights_hash, "dtype": data_target.ref.dtype, "layers": layers}
    key = sha256_json({**base, "prompts": chosen.fingerprint(), "new_tokens": settings.new_tokens})[:16]
    seqs = _continuations(
        chosen, data_target, settings.new_tokens, cache_root() / "teacher" / f"{key}.sequences.json", progress
    )
    if settings.package_tokens:
        text = package_text(data_target.tokenizer, settings.package_tokens)
        seqs = seqs + text
        key = sha256_json({**base, "continuations": key, "text": sha256_json(text)})[:16]
    tokens, states, starts = _captured(model, seqs, layers, cache_root() / "teacher" / key, progress)
    return TeacherData(tokens, states, starts, layers, sha256_json({"prompts": chosen.fingerprint(), "data": key}))


def _continuations(
    chosen, data_target: LoadedModel, new_tokens: int, path: Path, progress: Callable[[str], None]
) -> list[list[int]]:
    """Each prompt in the chat template followed by the target's greedy continuation; resumes from `path`."""
    model, tok = data_target.model, data_target.tokenizer
    ids = encode_prompts(tok, chosen, context_tokens=model.config.max_position_embeddings, max_new_tokens=new_tokens)
    ids = sorted(ids, key=len)  # similar lengths batch together
    seqs: list[list[int]] = json.loads(path.read_text()) if path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    for start in range(len(seqs), len(ids), 16):
        out = generate(
            model, ids[start : start + 16], max_new_tokens=new_tokens, stop_token_ids=list(model.config.eos_token_ids)
        )
        seqs += [p + t for p, t in zip(ids[start : start + 16], out.tokens)]
        write_json(path, seqs)
        progress(f"data: continued {len(seqs)}/{len(ids)} training prompts with the target")
    return seqs


def _captured(
    model,
    seqs: list[list[int]],
    layers: tuple[int, ...],
    prefix: Path,
    progress: Callable[[str], None],
    shard: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The target run over `seqs` (teacher-forced), its states at `layers`: ([N] tokens, [N, W] bf16 states, row
    starts). Written as shards of `shard` sequences (prefix.NNNN.safetensors); shards already on disk are read, not
    recomputed."""
    from safetensors.torch import load_file, save_file

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokens, states = [], []
    for first in range(0, len(seqs), shard):
        path = prefix.with_name(f"{prefix.name}.{first // shard:04d}.safetensors")
        if not path.is_file():
            part_tokens, part_states = [], []
            with torch.inference_mode():
                for start in range(first, min(first + shard, len(seqs)), 8):
                    batch = seqs[start : min(start + 8, first + shard)]
                    width = max(len(s) for s in batch)
                    padded = torch.zeros((len(batch), width), dtype=torch.long)
                    for b, s in enumerate(batch):
                        padded[b, : len(s)] = torch.tensor(s)
                    cache = model.new_cache(len(batch), width)
                    _, hidden = model.forward_capture(
                        padded.to(model.device),
                        cache,
                        torch.zeros(len(batch), dtype=torch.long, device=model.device),
                        layers,
                        logits="none",
                    )  # [b, width, len(layers) * hidden]
                    for b, s in enumerate(batch):
                        part_tokens.append(torch.tensor(s))
                        part_states.append(hidden[b, : len(s)].to("cpu", torch.bfloat16))
            tmp = path.with_suffix(".tmp")
            save_file(
                {
                    "tokens": torch.cat(part_tokens),
                    "states": torch.cat(part_states).contiguous(),
                    "lengths": torch.tensor([len(s) for s in seqs[first : first + shard]]),
                },
                str(tmp),
            )
            tmp.rename(path)
            progress(f"data: target states for {min(first + shard, len(seqs))}/{len(seqs)} sequences")
        saved = load_file(str(path))
        tokens.append(saved["tokens"])
        states.append(saved["states"])
    lengths = [len(s) for s in seqs]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.cat(tokens), torch.cat(states), starts


def vocabulary_shortlist(data: TeacherData, size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The `size` most frequent token ids of the data (plus `always`), increasing; all ids when size is 0 or ≥ the
    vocabulary."""
    if size == 0 or size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.bincount(data.tokens, minlength=vocab_size).float()
    counts[list(always)] = float("inf")
    return counts.topk(size).indices.sort().values


def _batches(data: TeacherData, batch_tokens: int, generator: torch.Generator) -> list[list[int]]:
    """Rows grouped by length into batches of about `batch_tokens` padded tokens, in random order."""
    lengths = [data.starts[i + 1] - data.starts[i] for i in range(data.rows())]
    order = sorted(range(data.rows()), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[p] for p in perm]


# ---------------------------------------------------------------------------- training-time test


def ttt_mask(S: int, step: int, device) -> torch.Tensor:
    """[1, 1, S, step*S] bool: step `step`'s query at p sees step-1 keys at positions <= p and steps 2..step at p."""
    causal = torch.ones((S, S), dtype=torch.bool, device=device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None]


def ttt_attend(attn, cos, sin, kv: list, mask: torch.Tensor):
    """Attention for one unrolled step: this step's keys join the earlier steps' (kv grows), queries see `mask`."""

    def attend(x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = attn.qkv(x, cos, sin)  # [B, S, H, hd], [B, S, H_kv, hd] x2
        kv.append((k.transpose(1, 2), v.transpose(1, 2)))
        keys = torch.cat([a for a, _ in kv], dim=2)  # [B, H_kv, step*S, hd]
        values = torch.cat([b for _, b in kv], dim=2)
        out = gqa_attention(q.transpose(1, 2), keys, values, mask)  # [B, H, S, hd]
        return attn.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    return attend


def ttt_loss(
    head: DraftHead,
    batch: dict,
    vocab: torch.Tensor,
    label_weight: torch.Tensor,
    settings: TrainSettings,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The unrolled loss for one batch and the step-1..K agreement with the target's argmax (a diagnostic)."""
    tokens, aux, final, lengths = (
        batch["tokens"],
        batch["aux"],
        batch["final"],
        batch["lengths"],
    )  # [B,S], [B,S,W], [B,S,H], [B]
    B, S = tokens.shape
    p = torch.arange(S)
    with torch.no_grad():
        teacher = F.log_softmax((final @ label_weight.T).float(), dim=-1)  # [B, S, v]: log p_t over the shortlist
    token_in = torch.cat([tokens[:, 1:], tokens.new_zeros((B, 1))], dim=1)  # x_{p+1}
    hidden = head.combine(aux)  # [B, S, hidden]
    # [v, hidden]: a head with its own draft vocabulary has an LM head over exactly the shortlist; else the
    # target's, restricted
    student_weight = head.lm_head.weight if isinstance(head, DraftVocabulary) else head.lm_head.weight[vocab]
    kv: list = []
    loss = torch.zeros(())
    agree = []
    for k in range(1, settings.ttt_steps + 1):
        cos, sin = head.rope((p + k - 1)[None].expand(B, S))
        attend = ttt_attend(head.layer.self_attn, cos, sin, kv, ttt_mask(S, k, tokens.device))
        features, hidden = head.features_with(token_in, hidden, attend)
        logits = (features @ student_weight.T).float()  # [B, S, v]
        valid = (p[None] + k <= lengths[:, None] - 1) & (p[None] <= lengths[:, None] - 2)  # label p_{p+k} exists
        label = torch.cat(
            [teacher[:, k:], teacher.new_zeros((B, k, teacher.shape[-1]))], dim=1
        )  # [B, S, v]: log p_{p+k}
        kl = (label.exp() * (label - F.log_softmax(logits, dim=-1))).sum(-1)  # [B, S]
        loss = loss + settings.step_decay ** (k - 1) * kl[valid].sum() / valid.sum().clamp_min(1)
        with torch.no_grad():
            drafted = logits.argmax(-1)
            agree.append(float((drafted == label.argmax(-1))[valid].float().mean()))
            token_in = vocab[drafted]  # on-policy: the next step reads the head's own draft, as when drafting
    return loss, agree


def block_loss(
    head: DFlashHead,
    batch: dict,
    vocab: torch.Tensor,
    label_weight: torch.Tensor,
    settings: TrainSettings,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """The anchored-block loss for one batch and each slot's agreement with the target's argmax (a diagnostic)."""
    tokens, aux, lengths = batch["tokens"], batch["aux"], batch["lengths"]  # [B, S], [B, S, W], [B]
    B, S = tokens.shape
    bs, first, device = head.block_size, head.first_slot, tokens.device
    with torch.no_grad():
        teacher = F.log_softmax(
            (batch["final"] @ label_weight.T).float(), dim=-1
        )  # [B, S, v]: log p_t over the shortlist
        greedy = vocab[teacher.argmax(-1)]  # [B, S]: the target's greedy next token (target ids)
    n = max(1, S // bs)  # anchors per sequence: about as many block queries as context positions
    span = (lengths - 2).clamp_min(1).float()  # anchors in 1..len-2
    anchors = 1 + (torch.rand((B, n), generator=generator).to(device) * span[:, None]).long()  # [B, n]
    positions = torch.arange(S, device=device)[None].expand(B, S)
    context = head.context_kv(head.combine(aux), *head.rope(positions))
    slots = torch.arange(bs, device=device)
    block_pos = (anchors[:, :, None] + slots).reshape(B, n * bs)  # [B, Q]
    block_tokens = torch.full((B, n, bs), head.mask_token_id, dtype=torch.long, device=device)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    q_anchor = anchors.repeat_interleave(bs, dim=1)  # [B, Q]: each query's anchor
    q_block = torch.arange(n, device=device).repeat_interleave(bs)  # [Q]
    sees_ctx = torch.arange(S, device=device)[None, None, :] < q_anchor[:, :, None]  # [B, Q, S]
    sees_block = (q_block[:, None] == q_block[None, :])[None].expand(B, -1, -1)  # [B, Q, Q]
    mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]  # [B, 1, Q, S + Q]
    hidden = head.block_hidden(block_tokens.reshape(B, n * bs), *head.rope(block_pos), context, mask).reshape(
        B * n, bs, -1
    )
    label_pos = (anchors[:, :, None] + slots[first:] - first).reshape(B * n, bs - first)  # p per slot
    row = torch.arange(B, device=device).repeat_interleave(n)[:, None]
    valid = label_pos <= (lengths.repeat_interleave(n)[:, None] - 1)
    label_pos = label_pos.clamp_max(S - 1)
    forced = iter(
        greedy[row, label_pos].T
    )  # the token slot j "drafts" (what the next slot's Markov bias reads): the target's at p

    logits, _ = head.draft_logits(hidden, block_tokens.reshape(B * n, bs)[:, 0], lambda step: next(forced))
    loss, agree = torch.zeros((), device=device), []
    for j, step_logits in enumerate(logits):
        label = teacher[row[:, 0], label_pos[:, j]]  # [B*n, v]
        kl = (label.exp() * (label - F.log_softmax(step_logits, dim=-1))).sum(-1)
        ok = valid[:, j]
        loss = loss + math.exp(-j / settings.position_decay) * kl[ok].sum() / ok.sum().clamp_min(1)
        with torch.no_grad():
            agree.append(float((step_logits.argmax(-1) == label.argmax(-1))[ok].float().mean()))
    return loss, agree


def _batch(data: TeacherData, rows: list[int], n_aux: int, device) -> dict:
    lengths = [data.starts[i + 1] - data.starts[i] for i in rows]
    S = max(lengths)
    width = data.states.shape[1]
    tokens = torch.zeros((len(rows), S), dtype=torch.long)
    states = torch.zeros((len(rows), S, width), dtype=torch.float32)
    for b, i in enumerate(rows):
        a, z = data.starts[i], data.starts[i + 1]
        tokens[b, : z - a] = data.tokens[a:z]
        states[b, : z - a] = data.states[a:z].float()
    hidden = width // len(data.layers)
    aux = states[..., : n_aux * hidden] if n_aux else states[..., -hidden:]
    return {
        "tokens": tokens.to(device),
        "aux": aux.to(device),
        "final": states[..., -hidden:].to(device),
        "lengths": torch.tensor(lengths, device=device),
    }


# ---------------------------------------------------------------------------- measuring


def measure_al(
    target: LoadedModel, head: DraftHead, mechanism: str, settings: TrainSettings, by_domain: bool = False
) -> dict:
    """AL at the mechanism's evaluation D on held-back MT-Bench prompts (greedy; measured with the speculative loop),
    with the per-position acceptance (vLLM's: drafts whose first i+1 tokens were accepted, over drafts) and, when
    asked, the same per domain."""
    shared = {id(target.model.embed_tokens): target.model.embed_tokens, id(target.model.lm_head): target.model.lm_head}
    snapshot = copy.deepcopy(head, memo=shared).to(target.model.dtype)
    drafter = registry()[mechanism].from_head(snapshot)  # type: ignore[attr-defined]
    D = head_kind(mechanism).eval_draft_len
    prompts = select_prompts("mtbench", "held_back", settings.eval_prompts)
    ids = encode_prompts(
        target.tokenizer,
        prompts,
        context_tokens=target.model.config.max_position_embeddings,
        max_new_tokens=settings.eval_new_tokens,
        max_draft_tokens=D,
    )
    counters: list[SpecCounters] = []
    for start in range(0, len(ids), 8):
        run = generate(
            target.model,
            ids[start : start + 8],
            drafter=drafter,
            num_draft_tokens=D,
            max_new_tokens=settings.eval_new_tokens,
            stop_token_ids=list(target.model.config.eos_token_ids),
        )
        counters += run.per_prompt

    def summary(cs: list[SpecCounters]) -> dict:
        c = SpecCounters.total(cs)
        per_pos = [n / c.num_drafts if c.num_drafts else 0.0 for n in c.num_accepted_tokens_per_pos[:D]]
        return {
            "tokens_per_forward": c.tokens_per_target_forward,
            "mean_al_vllm": c.mean_acceptance_length,
            "per_position_acceptance": per_pos,
            "prompts": len(cs),
        }

    out = {
        **summary(counters),
        "conditional_acceptance": SpecCounters.total(counters).conditional_acceptance(),
        "split": "mtbench/held_back",
        "draft_len": D,
        "source": "measured",
    }
    if by_domain:
        domains: dict[str, list[SpecCounters]] = {}
        for p, c in zip(prompts.prompts, counters):
            domains.setdefault(p.domain, []).append(c)
        out["by_domain"] = {d: summary(cs) for d, cs in sorted(domains.items())}
    return out


# ---------------------------------------------------------------------------- the run


def train(settings: TrainSettings, progress: Callable[[str], None] | None = None) -> dict:
    """Prepare data, train within the budget, measure the learning curve, save; returns the training record."""
    mechanisms = tuple(head_kinds())
    if settings.mechanism not in mechanisms:
        raise SpecdecError(
            f"train-drafter trains {', '.join(mechanisms)}, not {settings.mechanism!r}",
            f"pass --mechanism {' or '.join(mechanisms)}",
        )
    settings.validate()
    say = progress or (lambda msg: log.info(msg))
    torch.manual_seed(settings.seed)
    t0 = time.perf_counter()
    target = load_model(
        settings.target, dtype="float32"
    )  # the head trains in fp32 and shares this target's embedding and head
    data_target = load_model(settings.target, dtype="auto") if cpu_has_native_bf16() else target
    data = teacher_data(settings, data_target, say)
    del data_target
    data_s = time.perf_counter() - t0
    model = target.model
    eos = tuple(model.config.eos_token_ids)
    vocab = vocabulary_shortlist(data, settings.draft_vocab, model.config.vocab_size, eos)
    kind = head_kind(settings.mechanism)
    n_aux = len(data.layers) - 1 if kind.reads_aux_states else 0
    head = kind.new(
        model,
        draft_vocab=vocab.tolist(),
        aux_layers=data.layers[:-1],
        seed=settings.seed,
        draft_layers=settings.draft_layers,
        block_size=settings.block_size,
        mask_token_id=default_mask_token(model.config.vocab_size, target.tokenizer),
        markov_rank=settings.markov_rank,
    )
    loss_of = block_loss if head.block else ttt_loss
    label_weight = model.lm_head.weight[vocab].detach()  # [v, hidden]: the target's head restricted to the shortlist
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.95))
    budget_s = 60 * settings.budget_minutes
    evals_at = [budget_s * (i + 1) / settings.eval_points for i in range(settings.eval_points)]
    g = torch.Generator().manual_seed(settings.seed)
    curve, trained_s, tokens_seen, steps, epochs = [], 0.0, 0, 0, 0
    say(
        f"data: {data.rows()} sequences, {data.tokens.numel()} tokens (profiling split), ready in {data_s:.0f} s; "
        f"training {sum(p.numel() for p in params) / 1e6:.1f}M parameters for {settings.budget_minutes:g} min"
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=cpu_has_native_bf16() and model.device.type == "cpu")
    last_loss, last_agree = float("nan"), []
    while trained_s < budget_s:
        epochs += 1
        for rows in _batches(data, settings.batch_tokens, g):
            if trained_s >= budget_s:
                break
            t_step = time.perf_counter()
            frac = trained_s / budget_s
            warm = min(1.0, frac / 0.03)
            lr = settings.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = _batch(data, rows, n_aux, model.device)
            head.train()
            with autocast:
                loss, agree = loss_of(head, batch, vocab.to(model.device), label_weight, settings, g)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            steps += 1
            tokens_seen += int(batch["lengths"].sum())
            last_loss, last_agree = float(loss.detach()), agree
            trained_s += time.perf_counter() - t_step
            if steps % 20 == 0:
                say(
                    f"step {steps}: {tokens_seen} tokens, loss {last_loss:.3f}, argmax agreement per step "
                    f"{', '.join(f'{a:.2f}' for a in agree)}, {trained_s:.0f}/{budget_s:.0f} s"
                )
            if evals_at and trained_s >= evals_at[0]:
                evals_at.pop(0)
                head.eval()
                t_eval = time.perf_counter()
                point = {
                    "training_tokens": tokens_seen,
                    "steps": steps,
                    "train_s": round(trained_s, 1),
                    **measure_al(target, head, settings.mechanism, settings, by_domain=not evals_at),
                }
                point["eval_s"] = round(time.perf_counter() - t_eval, 1)
                curve.append(point)
                say(
                    f"AL at D={point['draft_len']} after {tokens_seen} training tokens: "
                    f"{point['tokens_per_forward']:.3f} tokens/forward "
                    f"(measured on {point['prompts']} held-back MT-Bench prompts)"
                )
    head.eval()
    folder = settings.out or demo_head_folder(settings, target)
    record = {
        "mechanism": settings.mechanism,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(settings).items()},
        "target": dataclasses.asdict(target.ref),
        "data": {
            "split": "profile",
            "prompts_fingerprint": data.prompts_fingerprint,
            "sequences": data.rows(),
            "tokens": int(data.tokens.numel()),
            "prepare_s": round(data_s, 1),
        },
        "train": {
            "steps": steps,
            "epochs": epochs,
            "training_tokens": tokens_seen,
            "train_s": round(trained_s, 1),
            "final_loss": last_loss,
            "argmax_agreement_per_step": last_agree,
        },
        "learning_curve": curve,
        "draft_vocab": len(vocab),
    }
    _, verifier, verifier_config, _ = model_folder(settings.target)
    save_head(
        head,
        settings.mechanism,
        Path(folder),
        verifier=str(verifier),
        verifier_architectures=architectures(verifier_config, f"{verifier}/config.json"),
        speculative_tokens=head.max_drafts if head.block else settings.ttt_steps,
        extra=record,
    )
    record["folder"] = str(folder)
    return record


__all__ = ["TrainSettings", "block_loss", "cached_demo_head", "demo_head_folder", "measure_al", "train", "ttt_mask"]


register_demo_head(
    cached_demo_head
)  # head drafters given neither model= nor random= load it (trained here on first use)
