"""Starts ``python -m tests.multiprocess.worker`` in several JAX processes (each with its own
``XLA_FLAGS`` device count, joined over a loopback port with gloo) and collects each
``process{i}.pkl`` (logs in ``process{i}.log``). It never waits forever: after a failure the
others get ``grace`` seconds, past ``timeout`` every process is killed, and
:class:`LaunchError` names the process that failed first.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    """A worker process failed, or the processes ran past their time."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now; :class:`LaunchError` where none
    can be bound (no loopback interface, or a sandbox that forbids it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    except OSError as error:
        raise LaunchError(
            f"cannot bind a TCP port on the loopback address 127.0.0.1 ({error}): the "
            "multi-process tests need one for jax.distributed's coordinator"
        ) from error


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    # gloo prints a line per connection: noise in a failure message.
    text = [line for line in text if not line.startswith("[Gloo]")]
    return "\n".join(text[-lines:])


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kills the process and anything it started (its own session)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launch(
    scenarios: list[str],
    out: Path,
    *,
    processes: int = 2,
    devices: int = 4,
    timeout: float = 300.0,
    grace: float = 10.0,
    kill: tuple[int, str] | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Runs the worker's ``scenarios`` (in order) in ``processes`` processes (1: no
    ``jax.distributed``) of ``devices`` CPU devices each; returns each process's
    ``process{i}.pkl``, in process order. ``out``: an empty folder for outputs and logs;
    ``timeout``: seconds for the whole run; ``grace``: seconds the others get after a
    process fails; ``kill = (i, marker)``: SIGKILL process ``i`` once the worker has
    written ``out/marker`` (a fault injected mid-run); ``env``: extra variables.

    Raises:
      LaunchError: a process failed (named, with its log's tail), or the run ran past
        ``timeout``.
    """
    out.mkdir(parents=True, exist_ok=True)
    port = free_loopback_port() if processes > 1 else 0
    base = dict(os.environ)
    for name in list(base):
        if name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT")):
            del base[name]
    base.update(env or {})
    base["JAX_PLATFORMS"] = "cpu"
    base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out / f"process{i}.log" for i in range(processes)]
    try:
        for i in range(processes):
            command = [sys.executable, "-m", "tests.multiprocess.worker", str(out), str(i)]
            command += [str(processes), str(port), ",".join(scenarios)]
            with open(logs[i], "wb") as log:
                kw = dict(stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                procs.append(subprocess.Popen(command, cwd=ROOT, env=base, **kw))
        _supervise(procs, logs, out, timeout, grace, kill)
    finally:
        for proc in procs:
            _kill(proc)
    results = []
    for i in range(processes):
        with open(out / f"process{i}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _supervise(procs: list[subprocess.Popen[bytes]], logs: list[Path], out: Path, timeout: float,
               grace: float, kill: tuple[int, str] | None) -> None:  # fmt: skip
    start = time.monotonic()
    first_failure: tuple[int, int, float] | None = None  # (process, returncode, when)
    while True:
        now = time.monotonic()
        codes = [proc.poll() for proc in procs]
        if kill is not None and (out / kill[1]).exists() and codes[kill[0]] is None:
            _kill(procs[kill[0]])
            codes[kill[0]] = procs[kill[0]].returncode
        if first_failure is None:
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                first_failure = (failed[0], codes[failed[0]] or 0, now)
        if all(code is not None for code in codes):
            break
        if first_failure is not None and now - first_failure[2] > grace:
            break
        if now - start > timeout:
            running = [i for i, code in enumerate(codes) if code is None]
            for proc in procs:
                _kill(proc)
            raise LaunchError(
                f"the {len(procs)} processes ran past {timeout:.0f} s; process(es) "
                f"{running} still running were killed. Logs:\n"
                + "\n".join(f"--- process {i}\n{_tail(log)}" for i, log in enumerate(logs))
            )
        time.sleep(0.1)
    if first_failure is None:
        return
    i, code, _ = first_failure
    survivors = [j for j, proc in enumerate(procs) if proc.poll() is None]
    for proc in procs:
        _kill(proc)
    others = [
        f"process {j} {_describe(procs[j].returncode)}"
        for j in range(len(procs))
        if j != i and j not in survivors
    ]
    message = f"process {i} (pid {procs[i].pid}) {_describe(code)}"
    if survivors:
        message += f"; process(es) {survivors} still running after {grace:.0f} s were killed"
    if others:
        message += "; " + ", ".join(others)
    raise LaunchError(f"{message}.\n--- process {i} log:\n{_tail(logs[i])}")
