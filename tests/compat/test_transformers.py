"""transformers on ``stream_st.compat.install()``: save_pretrained and from_pretrained of tiny
models (tied, untied, sharded) give the same files, byte for byte, and the same logits as on
the reference; and a model built on the ``meta`` device takes its weights streamed over HTTP
with ``load_model(model, url, assign=True)``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

import stream_st.torch as st_pt

from ..servers.http_server import RangeHTTPServer

transformers = pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(
    """
    import json, sys
    out, installed = sys.argv[1], sys.argv[2] == "stream_st"
    if installed:
        import stream_st.compat
        stream_st.compat.install()
    import torch, transformers
    import safetensors, safetensors.torch
    results = {}
    for kind in ("tied", "untied", "sharded"):
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=kind != "untied",
        )
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
        shard = {"max_shard_size": "20KB"} if kind == "sharded" else {}
        model.save_pretrained(f"{out}/{kind}", **shard)
        again = transformers.GPT2LMHeadModel.from_pretrained(f"{out}/{kind}").eval()
        ids = torch.arange(12).reshape(1, 12)
        with torch.no_grad():
            torch.save(again(ids).logits, f"{out}/{kind}.logits")
            assert torch.equal(again(ids).logits, model(ids).logits)
    report = {
        "safetensors": safetensors.__name__,
        "safetensors.torch": safetensors.torch.__name__,
        "rust": "safetensors._safetensors_rust" in sys.modules,
    }
    print(json.dumps(report))
    """
)


def run(out: Path, variant: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), variant],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_save_and_from_pretrained_match_the_reference(tmp_path: Path) -> None:
    ours, reference = tmp_path / "stream_st", tmp_path / "reference"
    assert run(ours, "stream_st") == {
        "safetensors": "stream_st.compat",
        "safetensors.torch": "stream_st.torch",
        "rust": False,  # nothing of the reference was loaded
    }
    assert run(reference, "reference")["safetensors.torch"] == "safetensors.torch"
    for kind in ("tied", "untied", "sharded"):
        files = sorted(p.relative_to(reference) for p in (reference / kind).iterdir())
        assert files == sorted(p.relative_to(ours) for p in (ours / kind).iterdir())
        weights = [f for f in files if f.suffix == ".safetensors"]
        assert len(weights) > 1 if kind == "sharded" else len(weights) == 1
        for name in files:
            assert (ours / name).read_bytes() == (reference / name).read_bytes(), name
        got = torch.load(ours / f"{kind}.logits")
        assert torch.equal(got, torch.load(reference / f"{kind}.logits")), kind


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


def tiny(tie: bool) -> Any:
    return transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_meta_model_takes_its_weights_streamed_over_http(
    tmp_path: Path, http: RangeHTTPServer, sharded: bool
) -> None:
    config = tiny(tie=True)
    torch.manual_seed(1)
    source = transformers.GPT2LMHeadModel(config).eval()
    source.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if sharded else {}))
    for path in tmp_path.iterdir():
        http.objects[f"/org/model/{path.name}"] = path.read_bytes()
    name = "model.safetensors.index.json" if sharded else "model.safetensors"
    url = http.url(f"/org/model/{name}")

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    missing, unexpected = st_pt.load_model(model, url, assign=True, strict=False)
    assert not unexpected and missing <= {"lm_head.weight"}
    model.eval()
    assert not any(t.is_meta for t in model.state_dict().values())
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source(ids).logits)
