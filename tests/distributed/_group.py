"""Run a real gloo group of worker processes on 127.0.0.1 (see :mod:`._worker`)."""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

WAIT = 120.0
"""How long a group may take before the test fails (a hang, never a timing claim)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


ENV = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def _write(tmp: Path, world: int, params: dict[str, Any]) -> tuple[Path, Path]:
    out = tmp / f"out-{free_port()}"
    out.mkdir()
    params.update(world=world, port=free_port(), out=str(out))
    path = out / "params.json"
    path.write_text(json.dumps(params))
    return out, path


class Pool:
    """``size`` ranks in a group that stays up across tests (starting torch takes seconds)."""

    def __init__(self, size: int) -> None:
        port = free_port()
        self.size = size
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.distributed._worker",
                    "--serve",
                    str(port),
                    str(rank),
                    str(size),
                ],
                cwd=ROOT,
                env=ENV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(size)
        ]

    def run(self, tmp: Path, world: int, **params: Any) -> list[dict[str, Any]]:
        """Run a scenario on the first ``world`` ranks; each rank's report."""
        out, path = _write(tmp, world, params)
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(f"{path}\n")
            process.stdin.flush()
        deadline = time.monotonic() + WAIT
        with selectors.DefaultSelector() as waiting:
            for process in self.processes:
                assert process.stdout is not None
                waiting.register(process.stdout, selectors.EVENT_READ)
            left = len(self.processes)
            while left:
                ready = waiting.select(max(0.0, deadline - time.monotonic()))
                assert ready, "the group hung"
                for key, _ in ready:
                    line = key.fileobj.readline()  # type: ignore[union-attr]
                    assert line == "done\n", f"a rank of the pool ended: {line!r}"
                    waiting.unregister(key.fileobj)
                    left -= 1
        return _reports(out, world, [None] * world, [""] * world)

    def close(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def spawn(commands: list[list[str]]) -> tuple[list[int | None], list[str]]:
    """Run ``commands`` (one a rank) at once, each in a process of its own at the repository's
    root with :data:`ENV`: each one's exit status and standard error once every one has ended.
    One still running :data:`WAIT` seconds after the one before it ended fails the test (a hang),
    every process left killed."""
    processes = [
        subprocess.Popen(command, cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    errors = []
    try:
        for process in processes:
            errors.append(process.communicate(timeout=WAIT)[1])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [process.returncode for process in processes], errors


def run_group(tmp: Path, world: int, **params: Any) -> list[dict[str, Any]]:
    """Run ``world`` ranks in fresh processes with ``params``; each rank's report (see
    :mod:`._worker`)."""
    out, path = _write(tmp, world, params)
    codes, errors = spawn(
        [
            [sys.executable, "-m", "tests.distributed._worker", str(path), str(rank)]
            for rank in range(world)
        ]
    )
    return _reports(out, world, codes, errors)


def _reports(
    out: Path, world: int, codes: list[int | None], errors: list[str]
) -> list[dict[str, Any]]:
    reports = []
    for rank in range(world):
        report_path = out / f"rank{rank}.json"
        if not report_path.exists():
            reports.append({"rank": rank, "died": codes[rank], "stderr": errors[rank][-3000:]})
            continue
        report = json.loads(report_path.read_text())
        assert report["stream_st"].startswith(str(ROOT)), report["stream_st"]
        tensors = out / f"rank{rank}.safetensors"
        if tensors.exists():
            from safetensors.torch import load_file

            report["tensors"] = load_file(str(tensors))
        reports.append(report)
    return reports
