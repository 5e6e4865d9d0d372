"""Halfmoon operations console: `streamlit run console/app.py` (or `halfmoon serve console`).

Layout only: data comes from console.queries (SQL, read-only) and console.live (the
gateway's admin JSON), gathered per refresh in console.view; each tab's page is a module
of console.tabs, drawing figures from console.charts. Every page is drawn on every run
(tabs), inside one fragment that Streamlit reruns every HALFMOON_CONSOLE_REFRESH_S seconds.
"""

from __future__ import annotations

import hmac
import sys
from pathlib import Path

# Streamlit puts this file's folder on sys.path, not the repository root.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import streamlit as st  # noqa: E402

from console import queries  # noqa: E402
from console.settings import ConsoleSettings  # noqa: E402
from console.tabs import PAGES  # noqa: E402
from console.view import View  # noqa: E402

SETTINGS = ConsoleSettings.from_env()


# -- layout ---------------------------------------------------------------------------
@st.fragment(run_every=SETTINGS.refresh_s)
def pages(window_label: str, slo_ms: float) -> None:
    view = View.load(SETTINGS, queries.WINDOWS[window_label], slo_ms)
    for tab, (name, page) in zip(st.tabs(list(PAGES)), PAGES.items()):
        with tab:
            try:
                page(view)
            except Exception as exc:  # noqa: BLE001 - one broken page must not blank the rest
                st.error(f"The {name} page failed: {type(exc).__name__}: {exc}")


def admitted() -> bool:
    """Beyond loopback the console shows nothing until the visitor types the admin key:
    it reads every request record and the cluster's admin JSON."""
    if not SETTINGS.needs_login or st.session_state.get("admitted"):
        return True
    st.title("Halfmoon console")
    if not SETTINGS.admin_key:
        st.error(
            f"This console listens on {SETTINGS.host}, beyond this machine, and has no "
            "admin key to check visitors against: set HALFMOON_ADMIN_KEY or "
            "HALFMOON_ADMIN_KEY_FILE, or bind it to 127.0.0.1."
        )
        return False
    given = st.text_input("Admin key", type="password", key="login_key")
    if not given:
        st.info("Enter the cluster's admin key to continue.")
        return False
    if not hmac.compare_digest(given.strip().encode(), SETTINGS.admin_key.encode()):
        st.error("That is not the admin key.")
        return False
    st.session_state["admitted"] = True
    st.rerun()  # draw the console without the login form
    return True


def main() -> None:
    st.set_page_config(page_title="Halfmoon console", layout="wide")
    if not admitted():
        return
    st.sidebar.title("Halfmoon")
    window = st.sidebar.selectbox("Time window", list(queries.WINDOWS), index=1, key="window")
    slo_ms = st.sidebar.number_input(
        "TTFT SLO (ms)", min_value=1, value=2000, step=100, key="slo_ms"
    )
    st.sidebar.caption(f"Database: {queries.safe_url(SETTINGS.database_url)}")
    st.sidebar.caption(f"Gateway: {SETTINGS.gateway_url}")
    st.sidebar.caption(f"Refresh every {SETTINGS.refresh_s:g} s")
    pages(window, float(slo_ms))


main()
