"""The console's pages, one module per tab, in tab order. Each page draws one `View`."""

from __future__ import annotations

from typing import Callable

from console.tabs.benchmarks import benchmarks_page
from console.tabs.kv import kv_page
from console.tabs.overview import overview_page
from console.tabs.planner import planner_page
from console.tabs.pools import pools_page
from console.tabs.requests import requests_page
from console.view import View

PAGES: dict[str, Callable[[View], None]] = {
    "Overview": overview_page,
    "Pools": pools_page,
    "Planner": planner_page,
    "KV cache": kv_page,
    "Requests": requests_page,
    "Benchmarks": benchmarks_page,
}
