"""Server metrics in the Prometheus text exposition format (version 0.0.4), hand-written.

Counters and histograms live in one `Metrics` object owned by the app; gauges that belong
to the supervisor (queue depth, worker restarts, live workers) are read from its `stats()`
at scrape time and passed to `render`.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    """Cumulative-on-render histogram: `counts[i]` observations fell in bucket i (the last
    slot is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.observations += 1

    def lines(self, name: str) -> list[str]:
        out = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.observations}')
        out.append(f"{name}_sum {_number(self.total)}")
        out.append(f"{name}_count {self.observations}")
        return out


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class Metrics:
    """Everything the server counts itself."""

    requests: defaultdict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0
    cancelled: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests[(endpoint, str(status))] += 1

    def count_tokens(self, prompt: int, completion: int, reused: int) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.reused_tokens += reused

    def render(self, gauges: dict[str, float]) -> str:
        """The exposition text; `gauges` maps a metric suffix to its value."""
        lines: list[str] = []

        def header(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        header("tokenpipe_requests_total", "counter", "HTTP requests by endpoint and status.")
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(
                f'tokenpipe_requests_total{{endpoint="{_escape(endpoint)}",'
                f'status="{_escape(status)}"}} {count}'
            )
        for name, value, help_text in (
            ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
            (
                "completion_tokens_total",
                self.completion_tokens,
                "Generated tokens of finished requests (a request cancelled by a disconnect "
                "is not counted).",
            ),
            (
                "reused_prompt_tokens_total",
                self.reused_tokens,
                "Prompt tokens of finished requests reused from cache.",
            ),
            ("cancelled_requests_total", self.cancelled, "Requests cancelled by disconnects."),
        ):
            header(f"tokenpipe_{name}", "counter", help_text)
            lines.append(f"tokenpipe_{name} {value}")
        header("tokenpipe_time_to_first_token_seconds", "histogram", "Time to first token.")
        lines += self.ttft.lines("tokenpipe_time_to_first_token_seconds")
        header("tokenpipe_inter_token_latency_seconds", "histogram", "Time between tokens.")
        lines += self.itl.lines("tokenpipe_inter_token_latency_seconds")
        for name, gauge in sorted(gauges.items()):
            kind = "counter" if name.endswith("_total") else "gauge"
            header(f"tokenpipe_{name}", kind, name.replace("_", " ") + ".")
            lines.append(f"tokenpipe_{name} {_number(gauge)}")
        return "\n".join(lines) + "\n"
