"""Helpers for the tests that start the real server: ``vtoken-cli serve`` as a subprocess in its own session,
raw HTTP, ``/metrics`` reads, and the processes of the server's session (read from ``/proc``)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

CLI = [sys.executable, "-c", "from vtoken_cli.main import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Server:
    def __init__(self, model: Path, port: int, proc: subprocess.Popen, log: Path) -> None:
        self.model, self.port, self.proc, self.log = str(model), port, proc, log
        self.base = f"http://127.0.0.1:{port}"

    def metric(self, name: str) -> float:
        _, text = _get(self.base + "/metrics")
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(2))
        return total

    def client(self):  # noqa: ANN201
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)


def start_server(log: Path, model: Path, args: list[str], env: dict[str, str] | None = None) -> Server:
    """``vtoken-cli serve MODEL --port P --host 127.0.0.1 ARGS`` started in a session of its own (its pid is
    the session and process-group id); not waited for: see :func:`wait_healthy`."""
    port = _free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                **(env or {})}
    with open(log, "w") as fh:
        proc = subprocess.Popen([*CLI, "serve", str(model), "--port", str(port), "--host", "127.0.0.1", *args],
                                stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return Server(model, port, proc, log)


def wait_healthy(srv: Server, timeout: float = 300) -> Server:
    """``srv`` once ``/health`` answers 200; ``RuntimeError`` with the log's tail if it exits or times out."""
    deadline = time.monotonic() + timeout
    while _get(srv.base + "/health", 2)[0] != 200:
        if srv.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start (rc={srv.proc.poll()}):\n{srv.log.read_text()[-4000:]}")
        time.sleep(0.5)
    return srv


def stop_server(srv: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL after 60 s; a no-op for a group already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(srv.proc.pid, signal.SIGTERM)
    try:
        srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # a child the server left behind (a test reports it first)
        os.killpg(srv.proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_server(log: Path, args: list[str], model: Path | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    """``vtoken-cli serve MODEL ARGS`` (SmolLM2 unless ``model``), healthy, stopped (its process group) on exit."""
    if model is None:
        from vtoken_bench.models import smollm2_path

        model = smollm2_path()
    srv = start_server(log, model, args, env)
    try:
        yield wait_healthy(srv)
    finally:
        stop_server(srv)


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (state, ppid, pgrp, session, ...), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def session_processes(sid: int) -> dict[int, str]:
    """``{pid: command line}`` of every live (not zombie) process whose session or process group is ``sid``."""
    out: dict[int, str] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        st = _stat(int(p.name))
        if st is None or st[0] == "Z" or sid not in (int(st[2]), int(st[3])):
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        out[int(p.name)] = cmd
    return out


def parent_of(pid: int) -> int | None:
    st = _stat(pid)
    return None if st is None else int(st[1])


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
