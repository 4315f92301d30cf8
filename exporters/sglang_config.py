"""SGLang: the plan's per-batch draft lengths as `--speculative-adaptive-config`, where the algorithm takes it, else one
server per concurrency band. K is written as steps = K, draft tokens = K+1, topk 1.

The adaptive controller (speculative/adaptive_spec_params.py, 0.5.x since PR #24055) reads a JSON *file* keyed by batch
size: `{"1": {"candidate_steps": [...]}, "5": {...}}`. A key is the lower bound of its range, looked up after the batch
is padded up to a CUDA-graph batch size (adaptive_step_router.py). With one candidate per key the controller cannot
move: the file is a static per-batch table, exactly the plan's, provided `--cuda-graph-bs-decode` holds every band's
upper bound (so that padding never carries a batch into the next band). EAGLE / EAGLE3 (NEXTN is EAGLE) with topk 1
only; elsewhere SGLang turns adaptive off with a warning, so the bundle does not ask for it.

DFLASH and DSPARK draft the checkpoint's whole block in one step (DFLASH: draft tokens = block_size; DSPARK: block_size
drafts, draft tokens = block_size + 1): a band speculates at that D or not at all. Rules read in 0.5.23's
arg_groups/speculative_hook.py and speculative/adaptive_spec_params.py.
"""

from __future__ import annotations

import json
import shlex

from specdec_tune.exporters.engines import (
    Engine,
    EngineFiles,
    ExportContext,
    deviation,
    deviation_text,
    register,
    without_head,
)
from specdec_tune.exporters.native_checks import check_sglang
from specdec_tune.exporters.schedule import to_sglang
from specdec_tune.exporters.versions import gate

ADAPTIVE_FILE = "adaptive.json"


def _flags(ctx: ExportContext, k: int) -> list[str]:
    if k == 0:
        return []
    s = ctx.spelling.sglang
    assert s is not None, "a band that speculates has an SGLang algorithm (render returns first where there is none)"
    flags = ["--speculative-algorithm", s.algorithm]
    model = ctx.checkpoint_for("sglang")
    if model and not s.lookup:
        flags += ["--speculative-draft-model-path", model]
    if s.lookup:
        return flags + ["--speculative-num-draft-tokens", str(k + 1), "--speculative-ngram-max-bfs-breadth", "1"]
    if s.fixed_block:  # one step drafts the block: the verify window is the anchor and its K drafts
        return flags + ["--speculative-num-draft-tokens", str(k + 1)]
    return flags + [
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
    ]


def _launch(ctx: ExportContext, extra: list[str]) -> list[str]:
    memory = ctx.memory
    fraction = ["--mem-fraction-static", f"{memory['mem_fraction_static']:g}"] if memory else []
    return ["python", "-m", "sglang.launch_server", "--model-path", ctx.target_model, *fraction, *extra]


def adaptive_table(bands: list[tuple[int, int, int]]) -> dict:
    """The adaptive config file: each band's lower batch bound -> its one candidate step count."""
    return {str(lo): {"candidate_steps": [k]} for lo, _, k in bands}


def render(ctx: ExportContext) -> EngineFiles:
    version = ctx.versions["sglang"]
    decisions: list[str] = []
    gates: list[dict] = []
    s = ctx.spelling.sglang
    doc: dict
    if ctx.speculates and s is None:
        decisions.append(f"SGLang has no {ctx.mechanism} speculative algorithm: nothing to launch for this plan")
        doc = {"supported": False, "mechanism": ctx.mechanism, "bands": []}
        return EngineFiles({"bands.json": json.dumps(doc, indent=2) + "\n"}, doc, decisions, gates)
    # past the return above, a plan that speculates has an SGLang algorithm: `s is not None` only tells the type checker
    if ctx.speculates and s is not None and s.gated:
        gates.append(gate("sglang", f"algorithm:{s.algorithm}", version))
    runs = list(ctx.schedule)
    deviation_record = without_head(ctx, "sglang")
    if deviation_record:
        runs = deviation_record["schedule"]
        decisions.append(deviation_text(deviation_record))
    elif ctx.speculates and s is not None and s.fixed_block:
        block = ctx.spelling.drafts_per_block(ctx.head)
        runs = [(b, block if d else 0) for b, d in ctx.schedule]
        if runs != list(ctx.schedule):
            deviation_record = deviation(
                ctx, runs, f"{s.algorithm} drafts the checkpoint's whole block ({block} drafts) where it speculates"
            )
            decisions.append(deviation_text(deviation_record))
    bands = to_sglang(runs)
    memory = ctx.memory
    if memory:
        decisions.append(
            f"--mem-fraction-static {memory['mem_fraction_static']:g} (weights and the KV pool: the plan's "
            f"{memory['gpu_memory_utilization']:g} of the device less its activations) and --max-running-requests at "
            "each band's top, which fits at its D"
        )
    doc = {
        "supported": True,
        "mechanism": ctx.mechanism,
        "bands": [
            {
                "min_concurrency": lo,
                "max_concurrency": hi,
                "draft_len": k,
                "argv": _launch(ctx, ["--max-running-requests", str(hi), *_flags(ctx, k)]),
            }
            for lo, hi, k in bands
        ],
    }
    files: dict[str, str] = {}
    g = gate("sglang", "speculative_adaptive", version)
    if s is not None and s.adaptive and ctx.speculates and len(bands) > 1 and g["emitted"]:
        gates.append(g)
        table = adaptive_table(bands)
        graph_sizes = sorted({hi for _, hi, _ in bands})
        doc["adaptive"] = {
            "config_file": ADAPTIVE_FILE,
            "config": table,
            "argv": _launch(
                ctx,
                [
                    "--max-running-requests",
                    str(ctx.max_batch),
                    *_flags(ctx, max(k for *_, k in bands)),
                    "--speculative-adaptive",
                    "--speculative-adaptive-config",
                    ADAPTIVE_FILE,
                    "--cuda-graph-bs-decode",
                    *map(str, graph_sizes),
                ],
            ),
        }
        files[ADAPTIVE_FILE] = json.dumps(table, indent=2) + "\n"
        decisions.append(
            f"per-batch draft length in one server: --speculative-adaptive-config {ADAPTIVE_FILE} with one candidate "
            f"step count per band ({', '.join(f'{lo}-{hi}: {k}' for lo, hi, k in bands)}), so the controller keeps the "
            f"plan's K; --cuda-graph-bs-decode {graph_sizes} ends a graph size at each band's top (keys are looked up "
            "after graph padding)"
        )
    elif len(bands) > 1:
        why = (
            "SGLang's adaptive controller runs EAGLE / EAGLE3 with topk 1 only"
            if s is not None and not s.adaptive
            else f"SGLang {version} has no --speculative-adaptive (since {g['since']})"
        )
        decisions.append(
            f"{len(bands)} concurrency bands, one server each (route each band's traffic to its server): {why}"
        )
    else:
        decisions.append("one server: one draft length for every batch size")
    files["bands.json"] = json.dumps(doc, indent=2) + "\n"
    files["launch.sh"] = _script(doc)
    return EngineFiles(files, doc, decisions, gates, deviation_record)


def _script(doc: dict) -> str:
    quote = lambda argv: " ".join(shlex.quote(a) for a in argv)  # noqa: E731
    head = "#!/usr/bin/env sh\n"
    if "adaptive" in doc:  # run from anywhere: the config file sits beside this script
        argv = doc["adaptive"]["argv"]
        at = argv.index(ADAPTIVE_FILE)
        return (
            head
            + "# SGLang: one server, the plan's draft length per batch size (adaptive.json); other paths are relative "
            "to the bundle\n"
            + 'here=$(cd "$(dirname "$0")" && pwd)\ncd "$here/.." || exit 1\n'
            + f'exec {quote(argv[:at])} "$here/{ADAPTIVE_FILE}" {quote(argv[at + 1 :])}\n'
        )
    bands = doc["bands"]
    if len(bands) == 1:
        return (
            head
            + '# SGLang: one server for every concurrency\ncd "$(dirname "$0")/.." || exit 1\nexec '
            + quote(bands[0]["argv"])
            + "\n"
        )
    out = (
        head + "# SGLang: one server per concurrency band; run the band that matches your load from the bundle folder\n"
    )
    for b in bands:
        out += (
            f"# concurrency {b['min_concurrency']}-{b['max_concurrency']}: D = {b['draft_len']}\n# {quote(b['argv'])}\n"
        )
    return out


def k_at(doc: dict, batch: int) -> int:
    """The K SGLang runs at `batch` under this document: the adaptive table's key at or below the batch after padding it
    up to a captured graph size (adaptive_step_router.py), else the band holding it."""
    if "adaptive" in doc:
        argv = doc["adaptive"]["argv"]
        graphs = [int(a) for a in argv[argv.index("--cuda-graph-bs-decode") + 1 :] if a.isdigit()]
        padded = min((g for g in graphs if g >= batch), default=batch)
        keys = sorted(int(k) for k in doc["adaptive"]["config"])
        key = max([k for k in keys if k <= padded], default=keys[0])
        return doc["adaptive"]["config"][str(key)]["candidate_steps"][0]
    return next(b["draft_len"] for b in doc["bands"] if b["min_concurrency"] <= batch <= b["max_concurrency"])


def rules(doc: dict, version: str) -> list[str]:
    """Bands cover 1..N without gaps; the steps / draft-tokens / topk triple follows server_args.py; the adaptive table
    runs each band's K at every batch size of the band."""
    out, expect = [], 1
    for band in doc.get("bands", []):
        if band["min_concurrency"] != expect:
            out.append(f"band starting at {band['min_concurrency']} leaves a gap after {expect - 1}")
        expect = band["max_concurrency"] + 1
        argv, k = band["argv"], band["draft_len"]
        flag = lambda name, argv=argv: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
        if k and flag("--speculative-num-draft-tokens") != str(k + 1):
            out.append(f"band {band['min_concurrency']}-{band['max_concurrency']}: draft tokens must be K+1 = {k + 1}")
        if k and flag("--speculative-num-steps") not in (None, str(k)):
            out.append(f"band {band['min_concurrency']}-{band['max_concurrency']}: steps must be K = {k}")
        if flag("--speculative-num-steps") is not None and flag("--speculative-eagle-topk") != "1":
            out.append("topk must be 1 for a linear draft")
    if "adaptive" in doc:
        for band in doc["bands"]:
            wrong = [
                b
                for b in range(band["min_concurrency"], band["max_concurrency"] + 1)
                if k_at(doc, b) != band["draft_len"]
            ]
            if wrong:
                out.append(
                    f"the adaptive table runs another K than {band['draft_len']} at batch {wrong[0]} "
                    "(graph padding crosses a band)"
                )
    return out


register(Engine("sglang", "sglang", "bands.json", "sglang-bands.schema.json", render, rules, check_sglang))
