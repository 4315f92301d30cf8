"""Learned heads (EAGLE-3, MTP, DFlash, DSpark) as ONNX: the graphs a serving engine runs each round, checked against
the heads' own drafting code in onnxruntime, with a TensorRT engine or the command that builds one.

  serial heads (EAGLE-3, MTP)
    combine.onnx  target_hidden [batch, tokens, W] -> hidden [batch, tokens, H]                      (EAGLE-3's fc)
    step.onnx     tokens [batch, tokens], hidden [batch, tokens, H], past_k, past_v [1, batch, H_kv, past, hd]
                  -> logits [batch, tokens, V_draft], carry [batch, tokens, H], present_k, present_v (past + tokens)
                  catch-up runs it once over the verified positions (hidden = combine(target states)); each further
                  draft step runs it with tokens = 1 and hidden = the previous step's carry: D - 1 calls for D drafts
  block heads (DFlash, DSpark)
    context.onnx  target_hidden [batch, tokens, W], past_k, past_v [layers, batch, H_kv, past, hd]
                  -> present_k, present_v
    block.onnx    tokens [batch, block], ctx_k, ctx_v [layers, batch, H_kv, ctx, hd] -> logits [batch, block, V_draft],
                  hidden [batch, block, H]     (block positions ctx .. ctx + block - 1; one call drafts the whole block)
    markov.onnx   prev [batch], hidden [batch, H], state [batch, r] -> bias [batch, V_draft], state  (DSpark: per slot)

batch, tokens, past and ctx are dynamic; the block is the checkpoint's (drafts beyond D are dropped). Every row of a
batch shares one past length, as in the draft model's graphs (exporters.onnx_export). Parity: onnxruntime against the
head's own code (HeadDrafter's cached step, BlockDrafter's context and block passes, the Markov step) in fp32 at
shapes other than the traced ones, every output, error scaled as in `check_parity`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.export import Dim

from specdec_tune import SpecdecError
from specdec_tune.exporters.onnx_export import (
    PARITY_TOLERANCE_FP32,
    Ranges,
    export_module,
    export_readme,
    inverse_frequencies,
    rope_tables,
    scaled_error,
    tensorrt_step,
)
from specdec_tune.formats import get_format
from specdec_tune.profiles.drafters.dflash import DFlashHead, block_mask
from specdec_tune.profiles.drafters.heads import DraftHead
from specdec_tune.profiles.drafters.quant import quantize_linear_weights
from specdec_tune.profiles.models.llama import KVCache, gqa_attention
from specdec_tune.records import sha256_file, write_json


def _causal(P, T: int, B: int, device) -> torch.Tensor:
    positions = torch.arange(T, device=device) + P
    return (torch.arange(P + T, device=device)[None, :] <= positions[:, None])[None, None].expand(B, 1, T, P + T)


class RotaryGraph(nn.Module):
    """A head's graph that places T tokens after `start` others: RoPE from float64 angles, traceable."""

    inv_freq: torch.Tensor  # a buffer (register_buffer), which the type checker cannot see

    def __init__(self, head: DraftHead) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("inv_freq", inverse_frequencies(head.config), persistent=False)

    def rope(self, T, start, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq, torch.arange(T) + start, dtype)


class HeadStep(RotaryGraph):
    """DraftHead.step over an explicit past: the head's one attention layer and its head."""

    def forward(self, tokens, hidden, past_k, past_v):
        B, T = tokens.shape
        P = past_k.shape[3]
        cos, sin = self.rope(T, P, hidden.dtype)
        attn, present = self.head.layer.self_attn, []

        def attend(x):
            q, k, v = attn.qkv(x, cos, sin)  # [B, T, H, hd], [B, T, H_kv, hd] x2
            keys, values = (
                torch.cat((past_k[0], k.transpose(1, 2)), dim=2),
                torch.cat((past_v[0], v.transpose(1, 2)), dim=2),
            )
            present.append((keys, values))
            out = gqa_attention(q.transpose(1, 2), keys, values, _causal(P, T, B, x.device))
            return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))

        logits, carry = self.head.step_with(tokens, hidden, attend)
        return logits, carry, present[0][0][None], present[0][1][None]


class HeadCombine(nn.Module):
    def __init__(self, head: DraftHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, target_hidden):
        return self.head.combine(target_hidden)


class BlockContext(RotaryGraph):
    """DFlash's context pass: new verified positions' keys and values appended to every layer's past."""

    def forward(self, target_hidden, past_k, past_v):
        T, P = target_hidden.shape[1], past_k.shape[3]
        ctx = self.head.combine(target_hidden)
        kv = self.head.context_kv(ctx, *self.rope(T, P, ctx.dtype))
        return (
            torch.stack([torch.cat((past_k[i], k), dim=2) for i, (k, _) in enumerate(kv)]),
            torch.stack([torch.cat((past_v[i], v), dim=2) for i, (_, v) in enumerate(kv)]),
        )


class BlockPass(RotaryGraph):
    """DFlash's block pass over a context of ctx positions: every block query sees all of it and the whole block."""

    def forward(self, tokens, ctx_k, ctx_v):
        B, S = tokens.shape
        L = ctx_k.shape[3]
        cos, sin = self.rope(S, L, ctx_k.dtype)
        mask = torch.ones((B, 1, S, L + S), dtype=torch.bool)
        hidden = self.head.block_hidden(tokens, cos, sin, [(ctx_k[i], ctx_v[i]) for i in range(ctx_k.shape[0])], mask)
        return self.head.lm_head(hidden).float(), hidden


class MarkovStep(nn.Module):
    def __init__(self, head: DFlashHead) -> None:
        super().__init__()
        self.markov = head.markov_head

    def forward(self, prev, hidden, state):
        bias, out = self.markov.step(prev, hidden, state if self.markov.head_type == "rnn" else None)
        return bias.float(), out if out is not None else state


# ---------------------------------------------------------------------------- graphs and their references


@dataclasses.dataclass
class Graph:
    file: str
    module: nn.Module
    inputs: list[str]
    outputs: list[str]
    example: Callable  # (batch, tokens, past, generator) -> input tensors
    dynamic: dict
    reference: Callable  # inputs -> the head's own outputs, in graph order
    ranges: Ranges


def _serial_graphs(head: DraftHead, max_batch: int, max_tokens: int, max_past: int) -> list[Graph]:
    c = head.config
    H, Hkv, hd = c.hidden_size, c.num_kv_heads, c.head_dim
    batch, tokens, past = (
        Dim("batch", min=1, max=max(max_batch, 2)),
        Dim("tokens", min=1, max=max(max_tokens, 2)),
        Dim("past", min=1, max=max(max_past, 2)),
    )
    opt_b = max(1, max_batch // 2)
    target_width = len(head.hidden_layers) * getattr(head, "target_hidden_size", H)

    def step_example(B, T, P, g):
        return (
            torch.randint(0, c.vocab_size, (B, T), generator=g),
            torch.randn((B, T, H), generator=g),
            torch.randn((1, B, Hkv, P, hd), generator=g),
            torch.randn((1, B, Hkv, P, hd), generator=g),
        )

    def step_reference(tokens, hidden, past_k, past_v):
        B, T = tokens.shape
        P = past_k.shape[3]
        cache = KVCache(c, 1, B, P + T, hidden.dtype, hidden.device)
        cache.k[0][:, :, :P], cache.v[0][:, :, :P] = past_k[0], past_v[0]
        logits, carry = head.step(tokens, hidden, cache, torch.full((B,), P, dtype=torch.long))
        return logits, carry, cache.k[0][None], cache.v[0][None]

    graphs = [
        Graph(
            "step.onnx",
            HeadStep(head),
            ["tokens", "hidden", "past_k", "past_v"],
            ["logits", "carry", "present_k", "present_v"],
            step_example,
            {
                "tokens": {0: batch, 1: tokens},
                "hidden": {0: batch, 1: tokens},
                "past_k": {1: batch, 3: past},
                "past_v": {1: batch, 3: past},
            },
            step_reference,
            {
                "tokens": ((1, 1), (opt_b, 1), (max_batch, max_tokens)),
                "hidden": ((1, 1, H), (opt_b, 1, H), (max_batch, max_tokens, H)),
                **{
                    n: (
                        (1, 1, Hkv, 1, hd),
                        (1, opt_b, Hkv, max(1, max_past // 2), hd),
                        (1, max_batch, Hkv, max_past, hd),
                    )
                    for n in ("past_k", "past_v")
                },
            },
        )
    ]
    if hasattr(head, "fc"):  # EAGLE-3 fuses its three target states; MTP reads the final state as is
        graphs.insert(
            0,
            Graph(
                "combine.onnx",
                HeadCombine(head),
                ["target_hidden"],
                ["hidden"],
                lambda B, T, P, g: (torch.randn((B, T, target_width), generator=g),),
                {"target_hidden": {0: batch, 1: tokens}},
                lambda x: (head.combine(x),),
                {
                    "target_hidden": (
                        (1, 1, target_width),
                        (opt_b, 1, target_width),
                        (max_batch, max_tokens, target_width),
                    )
                },
            ),
        )
    return graphs


def _block_graphs(head: DFlashHead, max_batch: int, max_tokens: int, max_past: int) -> list[Graph]:
    c, S = head.config, head.block_size
    Hkv, hd, n = c.num_kv_heads, c.head_dim, len(head.layers)
    W = len(head.hidden_layers) * head.target_hidden_size
    batch, tokens, past = (
        Dim("batch", min=1, max=max(max_batch, 2)),
        Dim("tokens", min=1, max=max(max_tokens, 2)),
        Dim("past", min=1, max=max(max_past, 2)),
    )
    opt_b = max(1, max_batch // 2)
    kv_range = ((n, 1, Hkv, 1, hd), (n, opt_b, Hkv, max(1, max_past // 2), hd), (n, max_batch, Hkv, max_past, hd))

    def context_reference(target_hidden, past_k, past_v):
        T, P = target_hidden.shape[1], past_k.shape[3]
        kv = head.context_kv(
            head.combine(target_hidden), *head.rope((torch.arange(T) + P)[None].expand(target_hidden.shape[0], T))
        )
        return (
            torch.stack([torch.cat((past_k[i], k), 2) for i, (k, _) in enumerate(kv)]),
            torch.stack([torch.cat((past_v[i], v), 2) for i, (_, v) in enumerate(kv)]),
        )

    def block_reference(tokens, ctx_k, ctx_v):
        B, L = tokens.shape[0], ctx_k.shape[3]
        cos, sin = head.rope((torch.arange(S) + L)[None].expand(B, S))
        hidden = head.block_hidden(
            tokens, cos, sin, [(ctx_k[i], ctx_v[i]) for i in range(n)], block_mask(torch.full((B,), L), L, S)
        )
        return head.lm_head(hidden).float(), hidden

    kv_example = lambda B, P, g: (
        torch.randn((n, B, Hkv, P, hd), generator=g),
        torch.randn((n, B, Hkv, P, hd), generator=g),
    )  # noqa: E731
    graphs = [
        Graph(
            "context.onnx",
            BlockContext(head),
            ["target_hidden", "past_k", "past_v"],
            ["present_k", "present_v"],
            lambda B, T, P, g: (torch.randn((B, T, W), generator=g), *kv_example(B, P, g)),
            {"target_hidden": {0: batch, 1: tokens}, "past_k": {1: batch, 3: past}, "past_v": {1: batch, 3: past}},
            context_reference,
            {
                "target_hidden": ((1, 1, W), (opt_b, 2, W), (max_batch, max_tokens, W)),
                "past_k": kv_range,
                "past_v": kv_range,
            },
        ),
        Graph(
            "block.onnx",
            BlockPass(head),
            ["tokens", "ctx_k", "ctx_v"],
            ["logits", "hidden"],
            lambda B, T, P, g: (torch.randint(0, c.vocab_size, (B, S), generator=g), *kv_example(B, P, g)),
            {"tokens": {0: batch}, "ctx_k": {1: batch, 3: past}, "ctx_v": {1: batch, 3: past}},
            block_reference,
            {"tokens": ((1, S), (opt_b, S), (max_batch, S)), "ctx_k": kv_range, "ctx_v": kv_range},
        ),
    ]
    if head.markov_head is not None:
        r, H = head.markov_head.rank, c.hidden_size
        graphs.append(
            Graph(
                "markov.onnx",
                MarkovStep(head),
                ["prev", "hidden", "state"],
                ["bias", "state_out"],
                lambda B, T, P, g: (
                    torch.randint(0, c.vocab_size, (B,), generator=g),
                    torch.randn((B, H), generator=g),
                    torch.randn((B, r), generator=g),
                ),
                {"prev": {0: batch}, "hidden": {0: batch}, "state": {0: batch}},
                lambda prev, hidden, state: MarkovStep(head)(prev, hidden, state),
                {
                    "prev": ((1,), (opt_b,), (max_batch,)),
                    "hidden": ((1, H), (opt_b, H), (max_batch, H)),
                    "state": ((1, r), (opt_b, r), (max_batch, r)),
                },
            )
        )
    return graphs


@torch.no_grad()
def check_graph_parity(graph: Graph, path: Path, cases: list[tuple[int, int, int]], seed: int = 1) -> dict:
    """onnxruntime against the head's own code at each (batch, tokens, past) case, every output."""
    import onnxruntime as ort

    runtime = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(seed)
    rows: list[dict] = []
    for B, T, P in cases:
        inputs = graph.example(B, T, P, g)
        expected = graph.reference(*inputs)
        got = runtime.run(None, {name: x.numpy() for name, x in zip(graph.inputs, inputs)})
        errs: dict[str, float] = {}
        for name, e, o in zip(graph.outputs, expected, got):
            o = torch.from_numpy(o)
            if tuple(o.shape) != tuple(e.shape):
                raise SpecdecError(
                    f"{graph.file}: onnxruntime returned {name} {tuple(o.shape)} for {tuple(e.shape)}",
                    "re-export the head",
                )
            errs[name] = scaled_error(float((o - e.float()).abs().max()), e)
        rows.append(
            {"batch": B, "tokens": T, "past": P, "parity_err_by_output": errs, "parity_err": max(errs.values())}
        )
    worst = max(r["parity_err"] for r in rows)
    return {
        "cases": rows,
        "parity_err": worst,
        "tolerance": PARITY_TOLERANCE_FP32,
        "passed": worst < PARITY_TOLERANCE_FP32,
        "runtime": f"onnxruntime {ort.__version__} (CPUExecutionProvider)",
    }


def export_head(
    head: DraftHead,
    out_dir: Path,
    *,
    name: str,
    max_batch: int = 64,
    max_draft_len: int = 8,
    ctx: int = 4096,
    quant: str = "none",
    parity_cases: list[tuple[int, int, int]] | None = None,
) -> dict:
    """Export a learned head for the bundle: its graphs, their parity in onnxruntime, TensorRT engines or skip records.

    Writes into out_dir the graphs, export.json and README.md (how to build the engines); returns export.json's content.
    Raises SpecdecError when a graph's parity fails (nothing should ship then)."""
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnxscript") is None:
        raise SpecdecError(
            "exporting the drafter to ONNX needs onnx, onnxscript and onnxruntime",
            "pip install onnx onnxscript onnxruntime",
        )
    get_format(quant)
    shared = {id(head.embed_tokens): copy.deepcopy(head.embed_tokens)}
    # either way a copy of `head`, of its class
    fp32 = cast(
        DraftHead,
        (quantize_linear_weights(head, quant) if quant != "none" else copy.deepcopy(head, memo=shared)).float().eval(),
    )
    fp32._rope_table = None
    block = fp32.block
    max_tokens = 1 + max_draft_len
    graphs = (
        _block_graphs(cast(DFlashHead, fp32), max_batch, max_tokens, ctx)  # only a DFlashHead drafts a block
        if block
        else _serial_graphs(fp32, max_batch, max_tokens, ctx)
    )
    top_batch = max(max_batch, 2)  # the graphs' dynamic ranges (a range of one value would be specialised away)
    cases = parity_cases or [(1, 1, 1), (min(top_batch, 3), max_tokens, 7), (min(top_batch, 5), 2, 17)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "drafter": name,
        "quant": quant,
        "shapes": {"max_batch": max_batch, "max_tokens": max_tokens, "max_past": ctx},
        "graphs": {},
        "files": [],
        "readme_extra": [_USAGE["block" if block else "serial"]],
    }
    for graph in graphs:
        example = graph.example(
            2, min(3, max(max_tokens, 2)), 5, torch.Generator().manual_seed(0)
        )  # inside every dynamic range
        path = export_module(graph.module, example, graph.dynamic, (graph.inputs, graph.outputs), out_dir / graph.file)
        parity = check_graph_parity(graph, path, cases)
        if not parity["passed"]:
            raise SpecdecError(
                f"{graph.file}: onnxruntime differs from torch by {parity['parity_err']:.2e} "
                f"(tolerance {PARITY_TOLERANCE_FP32:g})",
                "the export is wrong; nothing was written to the bundle",
            )
        result["graphs"][graph.file] = {
            "inputs": ", ".join(graph.inputs),
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "parity": parity,
            "tensorrt": tensorrt_step(path, graph.ranges, quant, result["files"]),
        }
        result["files"].append(graph.file)
    (out_dir / "README.md").write_text(export_readme(result, quant))
    result["files"] += ["README.md", "export.json"]
    write_json(out_dir / "export.json", result)
    return result


_USAGE = {
    "serial": "Per round: combine.onnx over the target states of the positions verified since the last round "
    "(EAGLE-3), step.onnx over them (it returns the first draft's logits at the last position and appends to the "
    "head's KV), then step.onnx once per further draft with tokens = 1 and hidden = the carry it returned.",
    "block": "Per round: context.onnx appends the verified positions' keys and values; block.onnx runs the block "
    "[last token, mask, ..., mask] once; DSpark then adds markov.onnx's bias slot by slot, each slot's previous token "
    "being the token the slot before it drafted.",
}

__all__ = ["BlockContext", "BlockPass", "HeadCombine", "HeadStep", "MarkovStep", "check_graph_parity", "export_head"]
