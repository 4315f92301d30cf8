"""A serving engine's own Prometheus metrics over a window: scrapes read from files or a running server's `/metrics`,
counters differenced between the first scrape and the last, gauges sampled at every scrape.

Each engine names its figures its own way (`ENGINE_METRICS`, a registry); what an engine does not count is said, not
guessed. The window's figures (`window_figures`):

    tokens per forward   TPF = generated / row-forwards over the window: vLLM, row-forwards = generated − accepted −
                         finished requests (each decode row-round emits 1 + its accepted drafts; a request's first
                         token comes from its prefill); SGLang counts its verify forwards per finished request
    mean accept length   vLLM's own: 1 + accepted / drafts (rounds that drafted), and per position i accepted_i / drafts
    concurrency          running + waiting requests at each scrape (the load offered; the server runs at most its
                         --max-num-seqs, the rest wait), and, with the window's length, Little's law over the finished
                         requests: mean requests in the system = Σ end-to-end latency / window
"""

from __future__ import annotations

import dataclasses
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from specdec_tune import SpecdecError

Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value) per label set


@dataclasses.dataclass(frozen=True)
class EngineMetrics:
    """One engine's metric names (sample names as scraped; None where it counts no such figure)."""

    engine: str
    generated: str  # counter: tokens generated
    running: str  # gauge: requests running
    waiting: str  # gauge: requests waiting
    latency_sum: str  # counter: the sum of finished requests' end-to-end latency (s)
    finished: str  # counter: requests finished
    accepted: str | None = None  # counter: draft tokens accepted
    drafts: str | None = None  # counter: rounds that drafted
    draft_tokens: str | None = None
    accepted_per_pos: str | None = None  # counter per `position` label
    forwards: str | None = None  # counter: target forwards of the finished requests
    not_counted: str = ""  # what the engine does not expose as counters

    @property
    def marker(self) -> str:
        """The sample whose presence says a scrape is this engine's."""
        return self.generated


ENGINE_METRICS = {
    m.engine: m
    for m in (
        EngineMetrics(
            engine="vllm",
            generated="vllm:generation_tokens_total",
            running="vllm:num_requests_running",
            waiting="vllm:num_requests_waiting",
            latency_sum="vllm:e2e_request_latency_seconds_sum",
            finished="vllm:e2e_request_latency_seconds_count",
            accepted="vllm:spec_decode_num_accepted_tokens_total",
            drafts="vllm:spec_decode_num_drafts_total",
            draft_tokens="vllm:spec_decode_num_draft_tokens_total",
            accepted_per_pos="vllm:spec_decode_num_accepted_tokens_per_pos_total",
        ),
        EngineMetrics(
            engine="sglang",
            generated="sglang:generation_tokens_total",
            running="sglang:num_running_reqs",
            waiting="sglang:num_queue_reqs",
            latency_sum="sglang:e2e_request_latency_seconds_sum",
            finished="sglang:e2e_request_latency_seconds_count",
            forwards="sglang:spec_verify_calls_total",
            not_counted=(
                "SGLang exposes its accept length and rate only as gauges of its last logging interval "
                "(sglang:spec_accept_length, sglang:spec_accept_rate), and no drafts or per-position counters: "
                "tokens per forward comes from its verify calls, counted as requests finish"
            ),
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Scrape:
    where: str  # the file or URL it came from
    samples: Samples
    at_s: float | None = None  # monotonic seconds when scraped (a live server); None for a file


def parse_scrape(text: str, where: str) -> Samples:
    """Prometheus text exposition -> samples by name; malformed text is refused in one line."""
    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except ValueError as e:
        raise SpecdecError(
            f"{where} is not a Prometheus text scrape ({str(e).splitlines()[0][:120]})",
            "give the text a server's /metrics returns",
        ) from None
    if not out:
        raise SpecdecError(f"{where} holds no metrics", "give the text a server's /metrics returns")
    return out


def _is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def scrape_url(url: str, timeout_s: float = 10.0) -> Scrape:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (the user's own server)
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise SpecdecError(
            f"cannot read metrics from {url} ({reason})", "give the URL of a running server's /metrics"
        ) from None
    return Scrape(url, parse_scrape(text, url), time.monotonic())


def _files(source: str) -> list[Path]:
    path = Path(source)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in (".prom", ".txt", ".metrics"))
        if not found:
            raise SpecdecError(f"{path} holds no scrapes (*.prom, *.txt)", "give scrape files or their folder")
        return found
    if not path.is_file():
        raise SpecdecError(f"no scrape at {path}", "give a scrape file, a folder of them, or a /metrics URL")
    return [path]


def read_scrapes(sources: list[str], window_s: float | None, interval_s: float) -> list[Scrape]:
    """The scrapes of a window, in order: files (or folders of them) as given; one URL scraped at once, every
    `interval_s` and at the end of `window_s`."""
    urls = [s for s in sources if _is_url(s)]
    if urls and len(sources) > 1:
        raise SpecdecError("--metrics takes one URL, or scrape files", "give the server's /metrics URL alone")
    if urls:
        if not window_s:
            raise SpecdecError("a URL needs a window to scrape over", "pass --window, e.g. --window 10m")
        scrapes = [scrape_url(urls[0])]
        end = scrapes[0].at_s + window_s  # type: ignore[operator]
        while (now := time.monotonic()) < end:
            time.sleep(min(interval_s, end - now))
            scrapes.append(scrape_url(urls[0]))
        return scrapes
    scrapes = []
    for source in sources:
        for path in _files(source):
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise SpecdecError(f"cannot read {path} ({e})", "give a readable text scrape") from None
            scrapes.append(Scrape(str(path), parse_scrape(text, str(path))))
    return scrapes


def engine_of(scrape: Scrape) -> EngineMetrics:
    for metrics in ENGINE_METRICS.values():
        if metrics.marker in scrape.samples:
            return metrics
    markers = " or ".join(m.marker for m in ENGINE_METRICS.values())
    raise SpecdecError(
        f"{scrape.where} holds no serving engine's metrics this check reads (no {markers})",
        "scrape the serving engine's own /metrics",
    )


def _total(samples: Samples, name: str, where: str, label: str | None = None) -> dict[str, float]:
    """Sum over label sets (engines, models, streaming or not); per value of `label` where given."""
    if name not in samples:
        raise SpecdecError(
            f"{where} has no {name}", "scrape the serving engine with speculative decoding on, at its /metrics"
        )
    out: dict[str, float] = {}
    for labels, value in samples[name]:
        key = labels.get(label, "") if label else ""
        out[key] = out.get(key, 0.0) + value
    return out


def _delta(first: Scrape, last: Scrape, name: str, label: str | None = None) -> dict[str, float]:
    a, b = _total(first.samples, name, first.where, label), _total(last.samples, name, last.where, label)
    out = {k: b[k] - a.get(k, 0.0) for k in b}
    if any(v < 0 for v in out.values()):
        raise SpecdecError(
            f"{name} went backwards between {first.where} and {last.where} (the server restarted inside the window?)",
            "scrape a window within one server run",
        )
    return out


def _one(d: dict[str, float]) -> float:
    return sum(d.values())


def window_figures(scrapes: list[Scrape], window_s: float | None) -> dict:
    """The figures of a window (module docstring) from its scrapes: two at least, the first and last whole scrapes of
    one engine, those between at least its running and waiting gauges."""
    if len(scrapes) < 2:
        raise SpecdecError(
            "one scrape holds no window: counters count since the server started",
            "give two scrapes (the window's start and end) or a URL with --window",
        )
    first, last = scrapes[0], scrapes[-1]
    engine = engine_of(first)
    if engine_of(last) is not engine:  # the scrapes between need only the gauges
        raise SpecdecError(f"{last.where} is another engine's scrape than {first.where}", "scrape one server")
    if first.at_s is not None and last.at_s is not None:
        window_s = last.at_s - first.at_s
    generated = _one(_delta(first, last, engine.generated))
    finished = _one(_delta(first, last, engine.finished))
    out: dict = {
        "engine": engine.engine,
        "scrapes": len(scrapes),
        "window_s": window_s,
        "generated_tokens": generated,
        "finished_requests": finished,
        "not_counted": engine.not_counted or None,
    }
    if engine.accepted:
        accepted = _one(_delta(first, last, engine.accepted))
        drafts = _one(_delta(first, last, engine.drafts or ""))
        per_pos = _delta(first, last, engine.accepted_per_pos or "", label="position")
        out |= {
            "accepted_tokens": accepted,
            "drafts": drafts,
            "draft_tokens": _one(_delta(first, last, engine.draft_tokens or "")),
            "accepted_per_position": [per_pos[k] for k in sorted(per_pos, key=int)],
            "forwards": generated - accepted - finished,
        }
    else:
        out["forwards"] = _one(_delta(first, last, engine.forwards or ""))
    running = [_one(_total(s.samples, engine.running, s.where)) for s in scrapes]
    waiting = [_one(_total(s.samples, engine.waiting, s.where)) for s in scrapes]
    out["concurrency_samples"] = [int(round(r + w)) for r, w in zip(running, waiting)]
    out["running_samples"] = [int(round(r)) for r in running]
    latency = _one(_delta(first, last, engine.latency_sum))
    out["little_mean_concurrency"] = latency / window_s if window_s else None
    return out


_UNITS_S = {"s": 1, "m": 60, "h": 3600}


def duration_s(text: str, option: str) -> float:
    """'10m', '90s', '1h' or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise SpecdecError(f"{option} {text!r} is not a duration", f"pass e.g. {option} 10m, 90s or 1h")
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]
