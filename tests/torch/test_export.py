"""``hvdtrain export``'s PyTorch half in process: a checkpoint written in parts by pipeline stages
exports the whole model, and a tensor two names share is written once with its alias."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hvdtrain.checkpoint import sha256_of
from hvdtrain.torch.export import checkpoint_model, unshared, write_safetensors
from hvdtrain.torch.parts import part_bytes

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_a_checkpoint_in_parts_exports_every_stage_s_layers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    entries = []
    for stage, layers in enumerate((["0", "1"], ["2"])):
        modules = nn.ModuleDict({name: model[int(name)] for name in layers})
        params = [n for n, _ in modules.named_parameters()]
        data = part_bytes([modules], params, torch.optim.SGD(modules.parameters(), lr=0.1))
        path = tmp_path / f"step-00000005.stage-{stage}.part"
        path.write_bytes(data)
        entries.append({"file": path.name, "sha256": sha256_of(path), "bytes": len(data)})
    checkpoint = tmp_path / "step-00000005.ckpt"
    torch.save({"model": {}, "optimizer": {},
                "meta": {"parts": entries, "position": {"step": 5}}}, checkpoint)
    exported, meta = checkpoint_model(checkpoint)
    assert exported.keys() == model.state_dict().keys()
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
