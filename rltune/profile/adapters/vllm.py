"""vLLM ``/metrics``: Prometheus text exposition, from a file or scraped live.

Read: gauges and counters as they are (labels dropped, series of the same name summed — one
engine may expose one series per model or per finished-reason), histograms as count, sum, mean
and the 50th/90th percentiles interpolated within buckets the way Prometheus's
``histogram_quantile`` does. Names are kept as vLLM spells them (``vllm:num_requests_running``)
with ``/count``, ``/sum``, ``/mean``, ``/p50``, ``/p90`` appended for histograms.

Derived: ``vllm:spec_decode_acceptance_rate`` = accepted / draft tokens, when both counters exist.

A file is one snapshot (one row, step 0). During a run, :func:`scrape` reads a live endpoint with
a short time-out and :func:`delta` turns two snapshots into per-interval figures (counter and
histogram increments, gauges at the later snapshot).
"""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from collections import defaultdict

from rltune.errors import LogFormatError
from rltune.profile.adapters._text import ParsedLog
from rltune.profile.report import ParseReport

NAME = "vllm"
SCRAPE_TIMEOUT_S = 2.0  # a healthy engine answers /metrics in milliseconds; never stall a run on it
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(?:\s+\d+)?$")
_LE = re.compile(r'le="([^"]+)"')


def claims(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(("# TYPE vllm:", "vllm:")))


def parse_prometheus(text: str, report: ParseReport | None = None) -> dict[str, float]:
    """One snapshot: {metric name (with histogram suffixes): value}."""
    types: dict[str, str] = {}
    scalars: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    hist_sum: dict[str, float] = defaultdict(float)
    hist_count: dict[str, float] = defaultdict(float)
    for raw in text.splitlines():
        line = raw.strip()
        if report is not None:
            report.lines_total += 1
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 4 and parts[1] == "TYPE":
                types[parts[2]] = parts[3]
            continue
        match = _SAMPLE.match(line)
        value = _float(match.group(3)) if match else None
        if match is None or value is None:
            if report is not None:
                report.skip("malformed Prometheus sample line")
            continue
        name, labels = match.group(1), match.group(2) or ""
        if report is not None:
            report.lines_used += 1
        base = _histogram_base(name, types)
        if base is None:
            scalars[name] += value
        elif name.endswith("_bucket"):
            le = _LE.search(labels)
            if le is not None:
                bound = _float(le.group(1))
                if bound is not None:
                    buckets[base][bound] += value
        elif name.endswith("_sum"):
            hist_sum[base] += value
        else:
            hist_count[base] += value
    out = dict(scalars)
    for base in set(buckets) | set(hist_count) | set(hist_sum):
        out.update(_histogram_figures(base, buckets.get(base, {}), hist_count.get(base), hist_sum.get(base)))
    accepted = out.get("vllm:spec_decode_num_accepted_tokens_total")
    drafted = out.get("vllm:spec_decode_num_draft_tokens_total")
    if accepted is not None and drafted:
        out["vllm:spec_decode_acceptance_rate"] = accepted / drafted
    return out


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else value


def _histogram_base(name: str, types: dict[str, str]) -> str | None:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
            return name[: -len(suffix)]
    return None


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Quantile ``q`` from cumulative buckets {upper bound: count}, linear within the bucket."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):  # the answer lies above the last finite bound: report that bound
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return bounds[-1]


def _histogram_figures(base: str, buckets: dict[float, float], count: float | None,
                       total: float | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if count is None and buckets:
        count = buckets[max(buckets)]
    if count is not None:
        out[f"{base}/count"] = count
    if total is not None:
        out[f"{base}/sum"] = total
        if count:
            out[f"{base}/mean"] = total / count
    for q, label in ((0.5, "p50"), (0.9, "p90")):
        value = histogram_quantile(q, buckets)
        if value is not None:
            out[f"{base}/{label}"] = value
    out.update({f"{base}/bucket/{bound:g}": c for bound, c in buckets.items()})
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Figures for the interval between two snapshots: increments of counters and histograms, gauges as of ``after``.

    Histogram means and quantiles are recomputed from the incremented sums, counts and buckets.
    """
    out: dict[str, float] = {}
    hist_bases = {k.rsplit("/", 1)[0] for k in after if k.endswith("/count")}
    for key, value in after.items():
        if any(key.startswith(base + "/") for base in hist_bases):
            continue
        if key.endswith("_total"):
            out[key] = value - before.get(key, 0.0)
        elif key != "vllm:spec_decode_acceptance_rate":
            out[key] = value
    for base in hist_bases:
        bucket_keys = [k for k in after if k.startswith(base + "/bucket/")]
        buckets = {float(k.rsplit("/", 1)[1]): after[k] - before.get(k, 0.0) for k in bucket_keys}
        count = after.get(f"{base}/count", 0.0) - before.get(f"{base}/count", 0.0)
        total = after[f"{base}/sum"] - before.get(f"{base}/sum", 0.0) if f"{base}/sum" in after else None
        out.update(_histogram_figures(base, buckets, count, total))
    accepted = out.get("vllm:spec_decode_num_accepted_tokens_total")
    drafted = out.get("vllm:spec_decode_num_draft_tokens_total")
    if accepted is not None and drafted:
        out["vllm:spec_decode_acceptance_rate"] = accepted / drafted
    return out


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """Fetch and parse a live ``/metrics`` endpoint."""
    if not url.startswith(("http://", "https://")):
        raise LogFormatError(f"metrics.vllm_metrics_url {url!r} is not an http(s) URL; e.g. http://127.0.0.1:8000/metrics")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (scheme checked above)
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise LogFormatError(f"cannot scrape {url}: {exc}; is the vLLM server up and the URL right?") from None
    return parse_prometheus(text)


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    for step, (_, text) in enumerate(sources):
        snapshot = parse_prometheus(text, report)
        if snapshot:
            parsed.add(step, snapshot)
    report.note("a /metrics snapshot holds cumulative engine figures, not step times: one row per file")
    return parsed
