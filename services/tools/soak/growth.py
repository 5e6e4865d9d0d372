"""Growth of sampled series: a least-squares slope over the second half of a run, and
whether it is within bounds (pure: no processes, sockets or SQL here).

The slope judged is that of the series' floor, the lowest sample in each of a few equal
slices of the window, not of every sample. A leak raises the floor. Much else rises above
it and falls back: a garbage-collected heap between collections (nats-server is Go), rows
between retention prunes, a burst of traffic's buffers. A fit through every sample reads a
late burst as growth; the floor does not. The raw fit is reported beside it."""

from __future__ import annotations

from dataclasses import dataclass, replace

HOUR_S = 3600.0
MIN_POINTS = 5  # fewer samples in the window: too few to fit, not judged
# A series must cover this share of the window to be judged: a process restarted late in
# it (a fault) has too short a life there to tell a leak from its warm-up.
MIN_SPAN = 0.5
# Slices of the window whose lowest samples make the floor: enough to fit a line through,
# few enough that each holds several collections or prunes (5 minutes of a 30-minute half).
FLOOR_SLICES = 6
# Series that never fall, so a slope through them reads any new peak in the window as
# growth: Go's `Sys` (all the runtime ever took from the OS; it keeps the address space
# when it returns pages) steps up when a burst (a killed service's clients reconnecting,
# say) sets a new heap peak, and stays there. Shown, and used as the bound in
# runtime_bounded, never judged on its own: a leak shows in the live heap and the RSS.
HIGH_WATER_MARKS = frozenset({"go_sys_mib"})


@dataclass(frozen=True)
class Rule:
    """How much a kind of series may grow across the window: `relative` of its mean, but
    never less than `absolute` (a thread pool that starts one more worker is no leak)."""

    relative: float
    absolute: float


RULES = {
    "rss_mib": Rule(0.05, 2.0),
    "rss_anon_mib": Rule(0.05, 2.0),
    "go_sys_mib": Rule(0.05, 2.0),
    "go_heap_mib": Rule(0.05, 2.0),
    "fds": Rule(0.05, 2.0),
    "threads": Rule(0.05, 2.0),
    "rows": Rule(0.10, 50.0),
    "jetstream_msgs": Rule(0.10, 50.0),
    "jetstream_mib": Rule(0.10, 0.5),
}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of value over time (per second); 0 for fewer than two times."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in points) / var


def floor(points: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The lowest sample of each of FLOOR_SLICES equal slices of [t0, t1], at its own time
    (slices without a sample give nothing)."""
    width = (t1 - t0) / FLOOR_SLICES
    if width <= 0:
        return list(points)
    lowest: dict[int, tuple[float, float]] = {}
    for t, v in points:
        k = min(FLOOR_SLICES - 1, int((t - t0) / width))
        if k not in lowest or v < lowest[k][1]:
            lowest[k] = (t, v)
    return [lowest[k] for k in sorted(lowest)]


@dataclass(frozen=True)
class Growth:
    series: str  # e.g. "prefill-0 rss_mib", "sql requests rows"
    kind: str  # a RULES key
    points: int
    mean: float
    first: float
    last: float
    per_hour: float  # the floor's fitted growth per hour
    over_window: float  # the floor's fitted growth across the window (what is judged)
    raw_per_hour: float  # a fit through every sample, per hour (shown, not judged)
    allowed: float  # what the rule allows across the window
    span: float  # share of the window the series covers
    bounded_by: str = ""  # why growth past `allowed` is bounded (runtime_bounded)

    @property
    def covered(self) -> bool:
        """Enough samples over enough of the window to fit a line through."""
        return self.points >= MIN_POINTS and self.span >= MIN_SPAN

    @property
    def high_water(self) -> bool:
        return self.kind in HIGH_WATER_MARKS

    @property
    def judged(self) -> bool:
        return self.covered and not self.high_water

    @property
    def within_rule(self) -> bool:
        return self.over_window <= self.allowed

    @property
    def ok(self) -> bool:
        return not self.judged or self.within_rule or bool(self.bounded_by)


def judge(
    series: str, kind: str, points: list[tuple[float, float]], t0: float, t1: float
) -> Growth:
    """Growth of `points` within [t0, t1] (the second half of a run)."""
    window = [(t, v) for t, v in points if t0 <= t <= t1]
    rule = RULES[kind]
    s = slope(floor(window, t0, t1))
    mean = sum(v for _, v in window) / len(window) if window else 0.0
    return Growth(
        series,
        kind,
        len(window),
        mean,
        window[0][1] if window else 0.0,
        window[-1][1] if window else 0.0,
        s * HOUR_S,
        s * (t1 - t0),
        slope(window) * HOUR_S,
        max(rule.absolute, rule.relative * abs(mean)),
        (window[-1][0] - window[0][0]) / (t1 - t0) if window and t1 > t0 else 0.0,
    )


def runtime_bounded(growths: list[Growth]) -> list[Growth]:
    """RSS growth of a process whose runtime accounts for its memory (a Go program: its
    `Sys`, all it took from the OS) is bounded when that accounting did not rise in the
    window and the private RSS is still within it: the runtime is touching pages it
    already held, which it cannot do past `Sys`. Anything else is judged as it stands."""
    by = {(g.series, g.kind): g for g in growths}
    out = []
    for g in growths:
        sys_, anon = by.get((g.series, "go_sys_mib")), by.get((g.series, "rss_anon_mib"))
        if (
            g.kind in ("rss_mib", "rss_anon_mib")
            and not g.ok
            and sys_ is not None
            and sys_.covered
            and sys_.within_rule
            and anon is not None
            and anon.last <= sys_.last
        ):
            why = f"private RSS {anon.last:.1f} within Go's flat Sys {sys_.last:.1f} MiB"
            g = replace(g, bounded_by=why)
        out.append(g)
    return out


def table(growths: list[Growth]) -> str:
    """The report's table: one line per series, the worst first."""
    head = (
        f"{'series':<30} {'kind':<14} {'mean':>9} {'first':>9} {'last':>9} {'floor/h':>9} "
        f"{'all/h':>9}  verdict"
    )
    lines = [head, "-" * len(head)]
    shown = [g for g in growths if g.points]  # a process dead before the window: nothing
    for g in sorted(shown, key=lambda g: (g.ok, g.judged is False, g.series, g.kind)):
        verdict = "flat" if g.ok else f"GROWS (> {g.allowed:.1f} over the window)"
        if g.bounded_by:
            verdict = f"+{g.over_window:.1f} (> {g.allowed:.1f}), bounded: {g.bounded_by}"
        if g.high_water and g.covered:
            rose = "rose" if not g.within_rule else "held"
            verdict = f"high-water mark, not judged ({rose} {g.over_window:+.1f})"
        elif not g.judged:
            verdict = f"not judged: {g.points} samples over {g.span:.0%} of the window"
        lines.append(
            f"{g.series:<30} {g.kind:<14} {g.mean:>9.1f} {g.first:>9.1f} {g.last:>9.1f} "
            f"{g.per_hour:>+9.1f} {g.raw_per_hour:>+9.1f}  {verdict}"
        )
    return "\n".join(lines)
