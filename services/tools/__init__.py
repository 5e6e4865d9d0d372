"""Halfmoon's tools: what measures, simulates and breaks the serving processes, apart from them.

- `bench`: the benchmarks (`halfmoon bench ...`), each against a baseline from the same run.
- `sim`: the discrete-event simulator (`halfmoon sim`), driving the services' own policy code.
- `chaos`: faults under load against a live cluster (`halfmoon chaos`).

Imports run one way, so no tool is half of a circle with another:

    chaos -> bench -> sim -> services (public names only) -> shared

- sim never imports bench or chaos; bench never imports chaos (`bench replay --sim` drives
  the simulator, chaos drives the bench's streaming client).
- What two tools share and is pure (percentiles, the run summary and its SLOs) lives in
  shared/ (shared.stats, shared.run_summary), not in one tool for the other to reach into.
- A tool imports a serving process only by its public names (never an `_underscore` one),
  and no serving process imports a tool: only the `halfmoon` command (services/cli.py)
  dispatches to them.
"""
