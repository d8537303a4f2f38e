"""Data on disk at two ranks: every format in both frameworks learns the generated shapes, and a
bad image stops every rank with one line naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.conftest import BIN, ROOT, horovodrun, run_env
from tests.image_data import image_folder, npy_copy
from tests.multirank.conftest import PYTHON, WORKER

CONFIGS = {"torch": ROOT / "configs" / "images_torch.yaml",
           "tensorflow": ROOT / "configs" / "images_tf.yaml"}
# ResNet-18 at width 8 on 800 images of 32x32: chance is 0.1; both frameworks pass 0.3 within ten
# epochs (PyTorch's initialisation reaches more than Keras's).
COMMON = "model.options.width=8,data.batch_size=16,train.epochs=10,data.workers=1,log.tensorboard=false"
BAR = 0.3
SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    images = image_folder(root / "images", train=800, test=200, size=SIZE)
    return images, npy_copy(images, root / "npy", SIZE)


def runs(framework: str, images, npy) -> list[str]:
    out = [f"folder:{COMMON},data.options.root={images}",
           f"npy:{COMMON},data.name=npy,data.options={{}},data.options.root={npy},"
           "data.options.scale=0.00392156862745098,data.options.flip=true"]
    if framework == "torch":
        out.append(f"user:{COMMON},data.name=torch_dataset,data.options={{}},"
                   "data.options.train=tests.torch.user_datasets:PillowFolder,"
                   "data.options.test=tests.torch.user_datasets:PillowFolder,"
                   f"data.options.train_options.root={images}/train,"
                   f"data.options.test_options.root={images}/test")
    return out


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_every_format_learns_the_shapes_at_two_ranks(framework, data, tmp_path):
    names = runs(framework, *data)
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, str(tmp_path), str(CONFIGS[framework]), *names],
                      timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in (n.split(":")[0] for n in names):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["samples"] == 10 * 800, name
        assert summary["final"]["eval_accuracy"] >= BAR, (name, summary["final"])


@pytest.mark.timeout(600)
def test_a_truncated_image_stops_every_rank_with_one_line(data, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(data[0], root)
    victim = sorted((root / "train" / "square").iterdir())[3]
    victim.write_bytes(victim.read_bytes()[:300])
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--gloo", str(BIN / "hvdtrain"), "train",
           str(CONFIGS["torch"]), f"data.options.root={root}", "model.options.width=8",
           "data.workers=2", "train.epochs=1", "data.shuffle=false", f"log.dir={tmp_path / 'run'}",
           "log.wandb=disabled", "log.console=false"]
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=500)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if "hvdtrain: error: cannot read image" in line]
    assert lines and all(f"hvdtrain: error: cannot read image {victim}: " in line
                         for line in lines), output[-3000:]
