"""``hvdtrain export``'s PyTorch half in process: a checkpoint written in parts by pipeline stages
exports the whole model, each part mapped from its file, and a tensor two names share is written
once with its alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hvdtrain.checkpoint import sha256_of
from hvdtrain.torch.export import checkpoint_model, unshared, write_safetensors
from hvdtrain.torch.parts import part_bytes

safetensors_torch = pytest.importorskip("safetensors.torch")


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps the file ``path``."""
    return [(int(lo, 16), int(hi, 16)) for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(path)) for lo, hi in [line.split()[0].split("-")]]


def test_a_checkpoint_in_parts_exports_every_stage_s_layers(tmp_path):
    """Every stage's entries are exported, each mapped from its part's file (the parts are not
    read whole), and the logits of the exported weights are the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    entries, files = [], {}
    for stage, layers in enumerate((["0", "1"], ["2"])):
        modules = nn.ModuleDict({name: model[int(name)] for name in layers})
        params = [n for n, _ in modules.named_parameters()]
        data = part_bytes([modules], params, torch.optim.SGD(modules.parameters(), lr=0.1))
        path = tmp_path / f"step-00000005.stage-{stage}.part"
        path.write_bytes(data)
        entries.append({"file": path.name, "sha256": sha256_of(path), "bytes": len(data)})
        files.update({f"{layer}.{key}": path for layer in layers
                      for key in model[int(layer)].state_dict()})
    checkpoint = tmp_path / "step-00000005.ckpt"
    torch.save({"model": {}, "optimizer": {},
                "meta": {"parts": entries, "position": {"step": 5}}}, checkpoint)
    exported, meta = checkpoint_model(checkpoint)
    assert exported.keys() == model.state_dict().keys() == files.keys()
    for name, tensor in exported.items():  # in its part's pages, not copied out of them
        assert any(lo <= tensor.data_ptr() < hi for lo, hi in mapped_ranges(files[name])), name
    inputs = torch.randn(5, 3)
    rebuilt = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    rebuilt.load_state_dict(exported)
    with torch.no_grad():
        assert torch.equal(rebuilt(inputs), model(inputs))
    path = write_safetensors(exported, tmp_path / "out", meta)
    loaded = safetensors_torch.load_file(str(path))
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_a_shared_tensor_is_written_once_and_named_in_the_aliases(tmp_path):
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied, as GPT-2's head and token embedding
    model = nn.ModuleDict({"wte": embedding, "head": head})
    kept, aliases = unshared(model.state_dict())
    assert list(kept) == ["wte.weight"] and aliases == {"head.weight": "wte.weight"}
    path = write_safetensors(model.state_dict(), tmp_path, {"position": {"step": 3}})
    with safetensors_torch.safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["aliases"]) == aliases and f.metadata()["step"] == "3"
        assert torch.equal(f.get_tensor("wte.weight"), embedding.weight.detach())


def test_a_whole_checkpoint_is_mapped_and_exported_a_tensor_at_a_time(tmp_path):
    """A ring run's checkpoint: its tensors are mapped from the file (not read into memory),
    and the streamed safetensors file holds them, the tied one once, with the step."""
    from hvdtrain.torch.export import checkpoint_model, mapped_state

    embedding, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"wte": embedding, "head": head, "norm": nn.LayerNorm(4)}).to(
        torch.bfloat16)
    path = tmp_path / "step-00000007.ckpt"
    torch.save({"model": model.state_dict(), "optimizer": {},
                "meta": {"position": {"step": 7}}}, path)
    state = mapped_state(path)
    mapped = mapped_ranges(path)
    assert mapped and all(any(lo <= t.data_ptr() < hi for lo, hi in mapped)
                          for t in state["model"].values())  # in the file's pages, not copied
    entries, meta = checkpoint_model(path)
    written = write_safetensors(entries, tmp_path / "out", meta)
    with safetensors_torch.safe_open(str(written), "pt") as f:
        assert json.loads(f.metadata()["aliases"]) == {"head.weight": "wte.weight"}
        assert f.metadata()["step"] == "7" and set(f.keys()) == {"wte.weight", "norm.weight",
                                                                  "norm.bias"}
        for key in f.keys():  # noqa: SIM118  (a safe_open handle is no dict)
            assert torch.equal(f.get_tensor(key), model.state_dict()[key]), key
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception, match=r"junk\.ckpt"):
        mapped_state(tmp_path / "junk.ckpt")
