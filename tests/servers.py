"""Starting and stopping servers in tests: a free port, health polling, `python -m lorazor serve` in
a session of its own, and stopping its whole process group (also on timeout)."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, seconds: float = 180, proc: subprocess.Popen | None = None) -> None:
    """Poll `url/health` until it answers 200 (bounded in time); with `proc`, the server's process,
    raise at once if it exits first (its output is the caller's to show)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before {url} answered")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no server at {url} after {seconds} s")


def start_serve_command(*args, stdout=subprocess.PIPE, env=None) -> subprocess.Popen:
    """`python -m lorazor serve *args` in a session of its own, so the server and every process it
    starts (its engine, Ray) stop together (`stop_process_group`)."""
    return subprocess.Popen([sys.executable, "-m", "lorazor", "serve", *args], stdout=stdout, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True)


def stop_process_group(proc: subprocess.Popen, timeout: float = 60) -> str:
    """SIGINT to the command's process group, SIGKILL if it outlives `timeout` s; its output."""
    def signal_group(sig):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # every process of the group has exited
            pass

    if proc.poll() is None:
        signal_group(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        out, _ = proc.communicate()
    signal_group(signal.SIGKILL)  # children left behind by a server that exited
    return out or ""


def run_uvicorn(app, limit_concurrency=None, header_timeout: float | None = None):
    """`app` on a free loopback port, on a thread, with the server's own protocol (`header_timeout`
    seconds for a request head, else its default); returns (url, stop)."""
    import threading

    import uvicorn

    from lorazor.serve.guards import GuardedH11Protocol

    protocol = GuardedH11Protocol if header_timeout is None else type(
        "Protocol", (GuardedH11Protocol,), {"HEADER_TIMEOUT_S": header_timeout})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol,
                                           limit_concurrency=limit_concurrency))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return url, stop


def copy_testbed_lora_root(tmp_path_factory):
    """A runtime-loading root holding copies of the testbed's sql and math adapter folders."""
    import shutil

    from lorazor.testbed import ASSETS

    root = tmp_path_factory.mktemp("lora_root")
    for name in ("sql", "math"):
        shutil.copytree(ASSETS / "adapters" / name, root / name)
    return root
