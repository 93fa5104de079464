"""A group load gives modules that load in their own way (a load pre-hook, spectral_norm's)
their tensors through ``load_state_dict``, as the reference's ``load_model`` does, and a model
with a load post-hook all its tensors (the hook is told what the reference tells it), in a real
gloo group (of one rank: what is checked is that rank's loading, not the exchange). It gives the
names whose ``state_dict()`` entry is not the model's own memory so too, and what it receives in
place counts as changed for autograd."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from ._group import ENV, ROOT, WAIT, free_port  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist
    import safetensors.torch as reference
    import stream_st.torch

    path, port = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )

    class Doubling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))
            self._register_load_state_dict_pre_hook(self.convert)

        def convert(self, state, prefix, *args):
            if prefix + "weight" in state:
                state[prefix + "weight"] = state[prefix + "weight"] * 2

    def model():
        built = torch.nn.Sequential(Doubling(), torch.nn.Linear(2, 2))
        torch.nn.utils.spectral_norm(built[1])
        return built

    torch.manual_seed(0)
    reference.save_model(model(), path)
    ours, ref = model(), model()
    got = stream_st.torch.load_model(ours, path, process_group=dist.group.WORLD)
    assert got == (set(), []), got
    reference.load_model(ref, path)
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name

    told = []
    def defaults(module, incompatible):  # a load post-hook: a default for what is missing
        told.append(sorted(incompatible.missing_keys))
        if "1.weight" in incompatible.missing_keys:
            module[1].weight.data.fill_(1.0)

    trained = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    reference.save_model(trained, path)
    hooked = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    hooked.register_load_state_dict_post_hook(defaults)
    got = stream_st.torch.load_model(hooked, path, process_group=dist.group.WORLD)
    assert got == (set(), []) and told == [[]], (got, told)
    assert torch.equal(hooked[1].weight, trained[1].weight)
    dist.destroy_process_group()
    print("ok")
    """
)


def _run_one_rank(source: str, tmp_path: Path) -> None:
    """Run ``source`` as a one-rank group's script (the file to write, the port) and expect
    ``ok`` from it."""
    script = tmp_path / "rank.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "m.safetensors"), str(free_port())],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_group_load_runs_the_model_s_own_loading(tmp_path: Path) -> None:
    _run_one_rank(SCRIPT, tmp_path)


OWN_MEMORY = textwrap.dedent(
    """
    import datetime, sys
    import torch, torch.distributed as dist
    import safetensors.torch as reference
    import stream_st.torch

    path, port = sys.argv[1], int(sys.argv[2])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    group = dist.group.WORLD

    class HookCopy(torch.nn.Module):  # a state-dict post hook hands out copies
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.register_buffer("steps", torch.zeros(2))
            self.register_state_dict_post_hook(HookCopy.copies)

        @staticmethod
        def copies(module, state, prefix, local_metadata):
            for name, tensor in list(state.items()):
                state[name] = tensor.clone()

    class Views(torch.nn.Module):  # conjugate and negative views: their bytes are not values
        def __init__(self):
            super().__init__()
            values = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
            self.register_buffer("conj", values.conj())
            self.register_buffer("neg", torch._neg_view(values.clone()))

    for build in (HookCopy, Views):
        reference.save_file(
            {name: torch.rand_like(t) for name, t in build().state_dict().items()}, path
        )
        ours, ref = build(), build()
        expected = reference.load_model(ref, path)
        got = stream_st.torch.load_model(ours, path, process_group=group)
        assert got == expected, (build.__name__, got, expected)
        loaded = reference.load_file(path)
        for name, tensor in ref.state_dict().items():
            assert torch.equal(tensor, loaded[name]), name
            assert torch.equal(ours.state_dict()[name], tensor), (build.__name__, name)

    def backward_refused(out):
        try:
            out.backward()
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc), exc
        else:
            raise AssertionError("a backward through the graph built before the load ran")

    tensors = {"weight": torch.full((1, 3), 5.0), "bias": torch.zeros(1)}
    stream_st.torch.save_file(tensors, path, checksums=True)
    model = torch.nn.Linear(3, 1)
    out = model(torch.ones(1, 3, requires_grad=True)).sum()
    stream_st.torch.load_model(model, path, process_group=group)
    assert torch.equal(model.weight, torch.full((1, 3), 5.0))
    backward_refused(out)

    data = bytearray(open(path, "rb").read())  # a damaged byte: the load fails part done
    data[-1] ^= 0x80
    open(path, "wb").write(data)
    model = torch.nn.Linear(3, 1)
    out = model(torch.ones(1, 3, requires_grad=True)).sum()
    try:
        stream_st.torch.load_model(model, path, process_group=group)
    except stream_st.RankFailedError as exc:
        assert "IntegrityError" in str(exc), exc
    else:
        raise AssertionError("a damaged file loaded")
    backward_refused(out)
    dist.destroy_process_group()
    print("ok")
    """
)


def test_a_group_load_receives_only_into_the_model_s_own_memory_and_tells_autograd(
    tmp_path: Path,
) -> None:
    """A state-dict post hook's copies are loaded (they were filled, the model left unchanged
    and success reported), conjugate and negative views as the reference loads them, and a
    backward through a graph built before the load raises as after the reference's ``copy_``
    (it used the new weights), as after a load that failed part done."""
    _run_one_rank(OWN_MEMORY, tmp_path)
