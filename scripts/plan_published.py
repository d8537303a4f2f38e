"""Writes the published profiles of hvdtrain/plan/published/ (docs/planner.md, "A published result").

``python scripts/plan_published.py`` rebuilds vgg16.json, resnet101.json and inception_v3.json from
the models' layer shapes (parameters and multiply-adds per layer, computed here) and one published
single-GPU rate per model. Nothing is fitted to the scaling results being checked: a layer's share of
the step is its share of the model's multiply-adds, the backward pass takes two thirds of the step
(twice the forward pass's arithmetic), and a gradient is ready when the backward pass has passed its
layer.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "hvdtrain" / "plan" / "published"
BATCH = 64
"""Per-GPU batch of the Horovod paper's benchmark (tf_cnn_benchmarks --batch_size 64)."""
RATES = {  # images/s of one P100, batch 64, synthetic data (tensorflow.org performance benchmarks)
    "vgg16": 154.0,
    "inception_v3": 142.0,
    # ResNet-101 is not in that table: per-image time interpolated linearly in multiply-adds
    # between ResNet-50 (219 img/s, 3.8 GFLOPs) and ResNet-152 (91.8 img/s, 11.3 GFLOPs), He et al.
    "resnet101": 1000.0 / (1000 / 219 + (1000 / 91.8 - 1000 / 219) * (7.6 - 3.8) / (11.3 - 3.8)),
}


def conv(name: str, cin: int, cout: int, kh: int, kw: int, out_hw: int, bias: bool = False,
         bn: bool = True) -> dict:
    """One convolution (+ batch norm's two vectors): params, multiply-adds, output elements."""
    params = kh * kw * cin * cout + (cout if bias else 0) + (2 * cout if bn else 0)
    return {"name": name, "params": params, "macs": kh * kw * cin * cout * out_hw * out_hw,
            "out": cout * out_hw * out_hw}


def fc(name: str, cin: int, cout: int) -> dict:
    return {"name": name, "params": cin * cout + cout, "macs": cin * cout, "out": cout}


def merge(name: str, parts: list[dict]) -> dict:
    """A block of several convolutions as one layer (its output: the last part's)."""
    return {"name": name, "params": sum(p["params"] for p in parts),
            "macs": sum(p["macs"] for p in parts), "out": parts[-1]["out"]}


def vgg16() -> list[dict]:
    layers, cin = [], 3
    for block, (width, count, hw) in enumerate([(64, 2, 224), (128, 2, 112), (256, 3, 56),
                                                (512, 3, 28), (512, 3, 14)], start=1):
        for i in range(1, count + 1):
            layers.append(conv(f"conv{block}_{i}", cin, width, 3, 3, hw, bias=True, bn=False))
            cin = width
    return [*layers, fc("fc6", 512 * 7 * 7, 4096), fc("fc7", 4096, 4096), fc("fc8", 4096, 1000)]


def resnet101() -> list[dict]:
    layers = [conv("conv1", 3, 64, 7, 7, 112)]
    cin = 64
    for stage, (width, blocks, hw) in enumerate([(64, 3, 56), (128, 4, 28), (256, 23, 14),
                                                 (512, 3, 7)], start=2):
        for b in range(blocks):
            parts = [conv("a", cin, width, 1, 1, hw), conv("b", width, width, 3, 3, hw),
                     conv("c", width, 4 * width, 1, 1, hw)]
            if b == 0:
                parts.insert(0, conv("down", cin, 4 * width, 1, 1, hw))
            layers.append(merge(f"conv{stage}_{b + 1}", parts))
            cin = 4 * width
    return [*layers, fc("fc", 2048, 1000)]


def _inception_a(name: str, cin: int, pool: int) -> dict:
    hw = 35
    return merge(name, [conv("1x1", cin, 64, 1, 1, hw), conv("5a", cin, 48, 1, 1, hw),
                        conv("5b", 48, 64, 5, 5, hw), conv("3a", cin, 64, 1, 1, hw),
                        conv("3b", 64, 96, 3, 3, hw), conv("3c", 96, 96, 3, 3, hw),
                        conv("pool", cin, pool, 1, 1, hw)]) | {"out": (224 + pool) * hw * hw}


def _inception_c(name: str, c7: int) -> dict:
    hw, cin = 17, 768
    parts = [conv("1x1", cin, 192, 1, 1, hw), conv("7a", cin, c7, 1, 1, hw),
             conv("7b", c7, c7, 1, 7, hw), conv("7c", c7, 192, 7, 1, hw),
             conv("d1", cin, c7, 1, 1, hw), conv("d2", c7, c7, 7, 1, hw),
             conv("d3", c7, c7, 1, 7, hw), conv("d4", c7, c7, 7, 1, hw),
             conv("d5", c7, 192, 1, 7, hw), conv("pool", cin, 192, 1, 1, hw)]
    return merge(name, parts) | {"out": 768 * hw * hw}


def _inception_e(name: str, cin: int) -> dict:
    hw = 8
    parts = [conv("1x1", cin, 320, 1, 1, hw), conv("3a", cin, 384, 1, 1, hw),
             conv("3b", 384, 384, 1, 3, hw), conv("3c", 384, 384, 3, 1, hw),
             conv("d1", cin, 448, 1, 1, hw), conv("d2", 448, 384, 3, 3, hw),
             conv("d3", 384, 384, 1, 3, hw), conv("d4", 384, 384, 3, 1, hw),
             conv("pool", cin, 192, 1, 1, hw)]
    return merge(name, parts) | {"out": 2048 * hw * hw}


def inception_v3() -> list[dict]:
    """Inception V3 without the auxiliary head (Szegedy et al. 2016; torchvision's layout)."""
    layers = [conv("Conv2d_1a_3x3", 3, 32, 3, 3, 149), conv("Conv2d_2a_3x3", 32, 32, 3, 3, 147),
              conv("Conv2d_2b_3x3", 32, 64, 3, 3, 147), conv("Conv2d_3b_1x1", 64, 80, 1, 1, 73),
              conv("Conv2d_4a_3x3", 80, 192, 3, 3, 71),
              _inception_a("Mixed_5b", 192, 32), _inception_a("Mixed_5c", 256, 64),
              _inception_a("Mixed_5d", 288, 64)]
    layers.append(merge("Mixed_6a", [conv("3x3", 288, 384, 3, 3, 17), conv("d1", 288, 64, 1, 1, 35),
                                     conv("d2", 64, 96, 3, 3, 35), conv("d3", 96, 96, 3, 3, 17)])
                  | {"out": 768 * 17 * 17})
    layers += [_inception_c("Mixed_6b", 128), _inception_c("Mixed_6c", 160),
               _inception_c("Mixed_6d", 160), _inception_c("Mixed_6e", 192)]
    layers.append(merge("Mixed_7a", [conv("a1", 768, 192, 1, 1, 17), conv("a2", 192, 320, 3, 3, 8),
                                     conv("b1", 768, 192, 1, 1, 17), conv("b2", 192, 192, 1, 7, 17),
                                     conv("b3", 192, 192, 7, 1, 17), conv("b4", 192, 192, 3, 3, 8)])
                  | {"out": 1280 * 8 * 8})
    layers += [_inception_e("Mixed_7b", 1280), _inception_e("Mixed_7c", 2048), fc("fc", 2048, 1000)]
    return layers


def profile(name: str, layers: list[dict], rate: float) -> dict:
    step = BATCH / rate
    forward, backward = step / 3, 2 * step / 3
    total = sum(x["macs"] for x in layers)
    out_layers, tensors, clock = [], [], 0.0
    for x in layers:
        share = x["macs"] / total
        out_layers.append({"name": x["name"], "params": x["params"], "forward_s": forward * share,
                           "backward_s": backward * share, "activation_bytes": 4 * x["out"] * BATCH})
    for x in reversed(out_layers):  # the backward pass runs from the last layer to the first
        clock += x["backward_s"]
        tensors.append({"name": x["name"], "bytes": 4 * x["params"], "ready_s": clock})
    return {"format": "hvdtrain-plan-profile/1",
            "model": {"framework": "published", "name": name, "options": {}},
            "batch_size": BATCH, "forward_s": forward, "backward_s": backward, "update_s": 0.0,
            "tensors": tensors, "layers": out_layers,
            "compression": {"none": {"ratio": 1.0, "kernel_s": 0.0, "collective": "allreduce"}},
            "source": f"published: {rate:.1f} images/s on one P100 at batch {BATCH} "
                      "(docs/planner.md); layer shares by multiply-adds, written by "
                      "scripts/plan_published.py"}


def main() -> None:
    for name, make in (("vgg16", vgg16), ("resnet101", resnet101), ("inception_v3", inception_v3)):
        layers = make()
        data = profile(name, layers, RATES[name])
        (OUT / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
        params = sum(x["params"] for x in layers)
        print(f"{name}: {params / 1e6:.1f} M parameters, {sum(x['macs'] for x in layers) / 1e9:.2f} "
              f"G multiply-adds, {len(layers)} layers, step {BATCH / RATES[name]:.3f} s")


if __name__ == "__main__":
    main()
