"""The adapter's layer list for pipeline stages: built-in ``mlp`` and a user's ``nn.Sequential``."""

from __future__ import annotations

import torch
from torch import nn

from hvdtrain.adapters import Layer, sequential_layers
from hvdtrain.data.digits import DigitsDataset as Digits
from hvdtrain.torch.models import MLP, ClassifierAdapter


def test_mlp_layers_chained_in_order_are_its_model_with_the_same_initial_values():
    spec = Digits().spec()
    adapter = MLP(hidden=[32, 16])
    torch.manual_seed(3)
    whole = adapter.build(spec)
    torch.manual_seed(3)
    layers = [make() for make in adapter.layers(spec)]
    assert [f.name for f in adapter.layers(spec)] == ["flatten", "fc1", "relu1", "fc2", "relu2",
                                                      "head"]
    chained = nn.Sequential(*layers)
    assert whole.state_dict().keys() == chained.state_dict().keys()
    for key, value in whole.state_dict().items():
        assert torch.equal(value, chained.state_dict()[key]), key
    x, y = torch.randn(5, 64), torch.tensor([0, 1, 2, 3, 4])
    loss, metrics = adapter.loss_and_metrics(whole, x, y)
    loss2, metrics2 = adapter.output_loss(chained(x), y)
    assert torch.equal(loss, loss2) and torch.equal(metrics["correct"], metrics2["correct"])


def test_a_sequential_model_gives_its_layers_and_any_other_model_none():
    class Seq(ClassifierAdapter):
        def build(self, spec):
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    class Other(ClassifierAdapter):
        def build(self, spec):
            return nn.Linear(64, 10)

    layers = Seq().layers(Digits().spec())
    assert layers is not None
    assert [f.name for f in layers] == ["0", "1"]
    assert isinstance(layers[1](), nn.Linear)
    assert Other().layers(Digits().spec()) is None
    assert sequential_layers(nn.ModuleList([nn.ReLU()])) is None
    assert Layer("x", nn.ReLU)().__class__ is nn.ReLU


def test_saved_activations_count_what_backward_still_needs_once_and_no_parameters():
    from hvdtrain.torch.stages import SavedActivations

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    meter = SavedActivations()
    with meter.hooks():
        losses = [model(torch.randn(8, 64)).sum() for _ in range(3)]  # three micro-batches held
    held = meter.current
    # Each micro-batch keeps its input (8 x 64) and the ReLU's output, saved by the ReLU and by
    # the second layer but counted once (8 x 32), float32; weights are parameters: not counted.
    assert held == 3 * 4 * (8 * 64 + 8 * 32) and meter.peak == held
    losses[0].backward()
    assert meter.current == 2 * held // 3  # the first micro-batch's graph is freed
    for loss in losses[1:]:
        loss.backward()
    assert meter.current == 0 and not meter.live and meter.peak == held
    with meter.hooks():  # one at a time (1F1B's steady state): the peak is one micro-batch's
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
    assert meter.peak == held // 3
