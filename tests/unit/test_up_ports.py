"""`halfmoon up`'s port check (services/up/ports.py), against real sockets."""

from __future__ import annotations

import os
import socket

from services.up import ports
from services.up.settings import UpSettings


def listening() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def free() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_planned_ports_follow_the_settings():
    s = UpSettings(port=8000, console_port=8501, metrics_base_port=9100)
    assert [u.port for u in ports.planned(s, metrics_children=4)] == [
        8000,
        8501,
        9100,
        9101,
        9102,
        9103,
    ]
    off = UpSettings(port=8000, console=False, metrics_base_port=0)
    assert [u.port for u in ports.planned(off, metrics_children=4)] == [8000]


def test_a_taken_console_port_is_one_line_naming_it_and_this_process():
    sock, port = listening()
    with sock:
        s = UpSettings(port=free(), console_port=port, metrics_base_port=0)
        lines = ports.taken(s, metrics_children=3)
    assert len(lines) == 1
    assert f"port {port} (the console) on 127.0.0.1 is taken" in lines[0]
    assert f"held by pid {os.getpid()}" in lines[0]
    assert "--console-port (HALFMOON_CONSOLE_PORT), or --no-console" in lines[0]


def test_a_taken_metrics_port_names_the_base_port_setting():
    sock, port = listening()
    with sock:
        s = UpSettings(port=free(), console=False, metrics_base_port=port)
        lines = ports.taken(s, metrics_children=1)
    assert len(lines) == 1 and f"port {port} (a service's /metrics)" in lines[0]
    assert "--metrics-base-port (HALFMOON_METRICS_BASE_PORT; 0 turns them off)" in lines[0]


def test_free_ports_pass():
    s = UpSettings(port=free(), console=False, metrics_base_port=0)
    assert ports.taken(s, metrics_children=3) == []
