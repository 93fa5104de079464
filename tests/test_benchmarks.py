"""The scripts in benchmarks/: what they time, and what they leave behind."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st.numpy

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function importing a benchmark's module, as the benchmarks import one another."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


def test_bench_ab_times_the_checkout_it_is_given(
    benchmarks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from the repository root, as documented, each side imported the root's stream_st
    ('-c' puts the working directory first on the path, before PYTHONPATH): A/B compared the code
    with itself. A checkout whose stream_st prints 42 is timed as 42 seconds."""
    fake = tmp_path / "checkout" / "stream_st"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import sys\nprint(42.0)\nsys.exit(0)\n")
    kv = tmp_path / "kv.safetensors"
    stream_st.numpy.save_file({"x": np.zeros(4, np.float32)}, str(kv))
    monkeypatch.chdir(ROOT)
    files = {"kv": kv, "big": kv}
    assert benchmarks("bench_ab")._run(fake.parent, "import", files, tmp_path) == 42.0


def test_bench_serve_stops_the_servers_it_started_and_leaves_no_folder(
    benchmarks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that failed to start (--libraries without uvicorn) left those started before it
    running, and with --dir every run left its empty working folder behind."""
    bench_serve, bench_read = benchmarks("bench_serve"), benchmarks("bench_read")
    stopped: list[str] = []

    class Server:
        def __init__(self, label: str) -> None:
            self.label, self.started = label, False

        def start(self) -> None:
            if self.label == "uvicorn":
                raise RuntimeError("uvicorn did not start")
            self.started = True

        def stop(self) -> None:
            if self.started:
                stopped.append(self.label)

    def servers(path: Path, folder: Path, libraries: bool) -> dict[str, Server]:
        return {label: Server(label) for label in ("nginx", "serve", "aiohttp", "uvicorn")}

    tiny = bench_read.BenchFile("serve", "tiny", (bench_read.TensorLayout("w", "F32", (4,)),))
    monkeypatch.setattr(bench_serve, "servers", servers)
    monkeypatch.setattr(bench_serve, "big_file", lambda label, mib: tiny)
    monkeypatch.setattr(bench_serve, "find_program", lambda name: name)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # main sets it; restored after the test
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    argv = ["bench_serve.py", "--libraries", "--repeat", "1", "--dir", str(tmp_path / "data")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(RuntimeError, match="uvicorn did not start"):
        bench_serve.main()
    assert stopped == ["nginx", "serve", "aiohttp"]
    assert list(temporary.iterdir()) == []


FIRST_USE = """
import sys
import bench_torch, safetensors.torch
variant, warm, src = sys.argv[1:]
for path in (warm, src):
    safetensors.torch.save_model(bench_torch.tiny_model(), path)
bench_torch.warm_up(variant, warm)
before = set(sys.modules)
if variant.startswith("file_"):
    bench_torch.load_file(variant, src)
else:
    bench_torch.load_model(variant, src, bench_torch.tiny_model())
print(sorted(set(sys.modules) - before))
"""


@pytest.mark.parametrize("variant", ["ours", "file_shared"])
def test_bench_torch_imports_a_variant_s_modules_before_the_timing(
    variant: str, tmp_path: Path
) -> None:
    """The child imported stream_st and its facades alone before the clock: the modules a
    call imports on first use (anyio's backend, the reader) were timed with the load (file_pread
    454 ms the first call, 64 ms the second). Its warm-up loads a tiny file the variant's way."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    path = os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-c", FIRST_USE, variant, str(tmp_path / "w"), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """The options each benchmark's ``--help`` lists, by path (``benchmarks/NAME.py``); a script
    that needs a package not installed is left out."""
    found = {}
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        done = subprocess.run(
            [sys.executable, str(script), "--help"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        if done.returncode and "ModuleNotFoundError" in done.stderr:
            continue
        assert done.returncode == 0, done.stderr
        found[f"benchmarks/{script.name}"] = done.stdout
    return found


def _options(text: str) -> set[str]:
    return set(re.findall(r"--\w[\w-]*", text)) - {"--help"}


def test_the_benchmark_commands_of_the_docs_take_only_options_their_scripts_have(
    helps: dict[str, str],
) -> None:
    """benchmarks.md gave ``bench_spark.py --scale 1 --rounds 3`` as a section's command long
    after the script had dropped ``--scale``: the command failed as written."""
    commands = re.findall(
        r"python (benchmarks/\w+\.py)([^`]*)`",
        (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8"),
    )
    unknown = {
        f"{script}{options}": _options(options) - _options(helps[script])
        for script, options in commands
        if script in helps and _options(options) - _options(helps[script])
    }
    assert not unknown, f"options the scripts do not take: {unknown}"


def test_every_option_of_a_benchmark_is_in_its_docstring(helps: dict[str, str]) -> None:
    """``--help`` listed options the docstring's usage lines never named (bench_ab --figures,
    bench_torch --skip-http, bench_header --only-sizes, bench_read --warmup and --no-rss,
    bench_network --warmup)."""
    missing = {}
    for script, text in helps.items():
        docstring = ast.get_docstring(ast.parse((ROOT / script).read_text(encoding="utf-8")))
        if absent := _options(text) - _options(docstring or ""):
            missing[script] = absent
    assert not missing, f"options their docstrings do not name: {missing}"


def test_bench_header_labels_the_wall_clock_rows(
    benchmarks: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sizes table labelled its rows with the clock's name cut to four letters: 'seco'."""
    bench_header = benchmarks("bench_header")
    times = {"seconds": 0.001, "cpu": 0.001, "stall": 0.0}
    monkeypatch.setattr(bench_header, "first_call", lambda *_: times)
    bench_header.bench_sizes([10], rounds=1, idle=0.0, base=None)
    labels = [line.split()[1] for line in capsys.readouterr().out.splitlines()[3:5]]
    assert labels == ["wall", "cpu"]


def test_bench_first_save_refuses_a_missing_dir(tmp_path: Path) -> None:
    """``--dir`` naming no folder was a FileNotFoundError traceback from ``mkdtemp``."""
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_first_save.py", "--dir", str(tmp_path / "missing")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.endswith(f"error: --dir {tmp_path / 'missing'}: no such directory\n")


def test_the_docs_give_the_request_counts_bench_hub_prints() -> None:
    """The counts of bench_hub.py (a fake Hub: the same every run) as benchmarks.md gives them;
    it said 9 against 16 for a file read with concurrency=4, which the script counts 8 against
    14."""
    pytest.importorskip("huggingface_hub", reason="the hub extra is not installed")
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_hub.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    counts = re.findall(r"\d+\+\d+=(\d+) +\d+\+\d+=(\d+)", done.stdout)
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    section = page.split("## Hugging Face Hub requests")[1].split("\n## ")[0]
    assert len(counts) == 5
    for ours, other in counts:
        assert re.search(rf"\b{ours} against\s[^;]*\b{other}\b", section), (ours, other)
