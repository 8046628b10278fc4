"""The series' counters as a patched server exports them: scraped from its own /metrics endpoint
(`--enable-metrics`) after the traffic, per TP rank, and compared with the hook's count of the
same events. The hook wraps the scheduler's methods; /metrics is what an operator sees, so a
counter the series forgot to increment, or increments on the wrong rank, shows as a mismatch."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from dataclasses import dataclass

# The flag a patched run's server gets, so that it has a /metrics endpoint to scrape.
METRICS_FLAG = "--enable-metrics"
SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SeriesCounter:
    """A Prometheus counter the series adds, and the hook's counter of the same events (None: the
    hook does not count them; the value is shown, not compared). `at_least`: the exported count
    may exceed the hook's (the unwind's counter also counts rounds that put back no batch; the
    decode misses' counter also counts a step's first miss, which waits for the host backups in
    flight and tries again before it retracts anyone)."""

    metric: str
    hook_counter: str | None
    at_least: bool = False


SERIES_COUNTERS = (
    SeriesCounter("sglang:num_prefill_unwinds_total", "unwinds", at_least=True),
    SeriesCounter("sglang:num_decode_allocation_misses_total", "decode_retractions", at_least=True),
    SeriesCounter("sglang:num_host_backup_waits_before_retraction_total", None),
    SeriesCounter("sglang:num_parked_chunk_releases_total", "parked_chunk_releases"),
    SeriesCounter("sglang:mamba_slot_misses_total", "mamba_slot_misses"),
)

# `name{label="value",...} number` (Prometheus text format; HELP/TYPE lines start with '#').
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_TP_RANK = re.compile(r'(?:^|,)\s*tp_rank="(?P<rank>[^"]*)"')


def parse(text: str) -> dict[str, dict[str, int]]:
    """The series' counters in a /metrics page: {metric: {tp_rank: value}}, other labels (a Mamba
    slot miss's outcome) summed. A counter's `_created` sample is not a count and is left out."""
    names = {counter.metric for counter in SERIES_COUNTERS}
    found: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample["name"] not in names:
            continue
        rank_label = _TP_RANK.search(sample["labels"] or "")
        rank = rank_label["rank"] if rank_label else "0"
        per_rank = found.setdefault(sample["name"], {})
        per_rank[rank] = per_rank.get(rank, 0) + round(float(sample["value"]))
    return found


def scrape(base_url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, dict[str, int]] | None:
    """The server's series counters, or None where /metrics could not be read."""
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
            return parse(response.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def disagreements(
    scraped: dict[str, dict[str, int]], hook_counts: dict[str, dict[str, int]], ranks: list[str]
) -> list[str]:
    """Where /metrics and the hook disagree, one line each (metric, rank, both counts)."""
    found = []
    for counter in SERIES_COUNTERS:
        if counter.hook_counter is None:
            continue
        counted = hook_counts.get(counter.hook_counter, {})
        for rank in ranks:
            exported, hooked = scraped.get(counter.metric, {}).get(rank, 0), counted.get(rank, 0)
            if exported < hooked or (exported != hooked and not counter.at_least):
                found.append(f"{counter.metric} rank {rank}: /metrics {exported}, the hook {hooked}")
    return found


def shown(scraped: dict[str, dict[str, int]]) -> str:
    """The counters that are not zero, as `name 0:n 1:m`; '-' where none is."""
    parts = []
    for counter in SERIES_COUNTERS:
        per_rank = {rank: n for rank, n in scraped.get(counter.metric, {}).items() if n}
        if per_rank:
            ranks = " ".join(f"{rank}:{n}" for rank, n in sorted(per_rank.items()))
            parts.append(f"{counter.metric.removeprefix('sglang:')} {ranks}")
    return ", ".join(parts) or "-"
