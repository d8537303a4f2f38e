"""KerasHub at two ranks (Gloo): a tiny GPT-2 that the test pretrains with Keras and writes with
``save_to_preset`` is fine-tuned by ``model.name=kerashub_causal_lm`` (TensorFlow); the run starts
at the pretrained model's loss, not a random one's, and its checkpoint exports to a ``.keras``
file and a ``.weights.h5`` file that Keras loads, with the trained model's logits."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT, horovodrun, hvdtrain_cli, read_jsonl
from tests.text_data import docs_corpus

keras_hub = pytest.importorskip("keras_hub")
import keras  # noqa: E402  (after keras_hub's skip)

SEQ = 64
TINY = {"vocabulary_size": 256, "num_layers": 2, "num_heads": 4, "hidden_dim": 64,
        "intermediate_dim": 256, "max_sequence_length": SEQ, "dropout": 0.0}


def windows(corpus: Path, count: int, seed: int) -> np.ndarray:
    """``count`` random windows of SEQ + 1 tokens of the corpus's training split."""
    tokens = np.fromfile(corpus / "train.bin", np.uint8)
    starts = np.random.default_rng(seed).integers(0, len(tokens) - SEQ - 1, count)
    return np.stack([tokens[s:s + SEQ + 1] for s in starts]).astype(np.int64)


def token_model(causal_lm) -> keras.Model:
    from hvdtrain.tensorflow.kerashub import token_model as wrap

    return wrap(causal_lm, SEQ)


def mean_loss(model: keras.Model, batch: np.ndarray) -> float:
    """The mean next-token cross-entropy of ``model`` (token ids -> logits) on ``batch``."""
    logits = model(batch[:, :-1], training=False)
    return float(np.mean(keras.losses.sparse_categorical_crossentropy(
        batch[:, 1:], logits, from_logits=True)))


def new_gpt2(seed: int):
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(**TINY),
                                         preprocessor=None)


def pretrain(corpus: Path, out: Path, steps: int = 120) -> float:
    """Trains a tiny KerasHub GPT-2 on the corpus, writes it with save_to_preset to ``out`` and
    returns its loss on held-out random windows."""
    causal_lm = new_gpt2(0)
    model = token_model(causal_lm)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch = windows(corpus, 16 * steps, 0)
    model.fit(batch[:, :-1], batch[:, 1:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    causal_lm.save_to_preset(str(out))
    return mean_loss(model, windows(corpus, 64, 10_000))


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    corpus = docs_corpus(tmp_path_factory.mktemp("text") / "docs")
    base = tmp_path_factory.mktemp("kerashub")
    pretrained_loss = pretrain(corpus, base / "pretrained")
    config = yaml.safe_load((ROOT / "configs" / "lm_tf.yaml").read_text())
    config["model"] = {"name": "kerashub_causal_lm",
                       "options": {"pretrained": str(base / "pretrained")}}
    (base / "kerashub.yaml").write_text(yaml.safe_dump(config))
    run = base / "run"
    proc = horovodrun(2, "gloo", [
        str(ROOT / ".venv" / "bin" / "hvdtrain"), "train", str(base / "kerashub.yaml"),
        f"data.options.root={corpus}", f"log.dir={run}", "log.console=false",
        "log.wandb=disabled", "log.every_steps=1", "train.max_steps=12", "optim.lr=0.0003",
        "optim.warmup_steps=0", "checkpoint.every_steps=12"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return corpus, base, run, pretrained_loss


def test_two_ranks_finetune_a_keras_hub_preset_from_its_loss(finetuned):
    """The first step's loss is the pretrained preset's (within the sampling noise of one batch
    of 32 windows), far below a random model's; training goes on from there."""
    corpus, _, run, pretrained_loss = finetuned
    random_loss = mean_loss(token_model(new_gpt2(0)), windows(corpus, 64, 10_000))
    assert pretrained_loss < random_loss - 1.5, (pretrained_loss, random_loss)
    records = [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "step" in r]
    first = records[0]
    print(f"pretrained {pretrained_loss:.3f}, random {random_loss:.3f}, first logged "
          f"{first['loss']:.3f}, step 12 {records[-1]['loss']:.3f}")
    assert first["step"] == 1
    assert abs(first["loss"] - pretrained_loss) < 0.3, (first["loss"], pretrained_loss)
    assert first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert 0.0 < first["token_accuracy"] < 1.0
    assert records[-1]["step"] == 12 and records[-1]["loss"] < random_loss - 1.5


def test_the_checkpoint_exports_to_keras_files_with_its_logits(finetuned):
    """``export --format keras`` and ``--format weights.h5`` give the logits of the model in the
    run's last checkpoint (step 12), which are not the pretrained preset's."""
    import json

    corpus, base, run, _ = finetuned
    [checkpoint] = sorted((run / "checkpoints").glob("step-*.ckpt"))
    with np.load(io.BytesIO(checkpoint.read_bytes()), allow_pickle=False) as npz:
        assert json.loads(str(npz["meta"]))["position"]["step"] == 12
        trained = token_model(new_gpt2(1))
        for i, var in enumerate(trained.variables):
            var.assign(npz[f"model/{i}"])
    batch = windows(corpus, 4, 99)[:, :-1]
    expected = np.asarray(trained(batch, training=False))
    for fmt in ("keras", "weights.h5"):
        proc = hvdtrain_cli("export", str(run), "--format", fmt, timeout=600)
        assert proc.returncode == 0 and f"exported to {run / f'export-{fmt}'}" in proc.stdout, \
            proc.stderr[-2000:]
    loaded = keras.saving.load_model(run / "export-keras" / "model.keras")
    np.testing.assert_allclose(np.asarray(loaded(batch, training=False)), expected, rtol=0,
                               atol=1e-5)
    weights = token_model(new_gpt2(2))
    weights.load_weights(run / "export-weights.h5" / "model.weights.h5")
    np.testing.assert_allclose(np.asarray(weights(batch, training=False)), expected, rtol=0,
                               atol=1e-5)
    pretrained = token_model(keras_hub.models.CausalLM.from_preset(str(base / "pretrained"),
                                                                    preprocessor=None))
    assert float(np.abs(np.asarray(pretrained(batch, training=False)) - expected).max()) > 1e-3


@pytest.mark.long
def test_sharded_stages_1_and_2_train_a_keras_hub_model_as_the_ring(tmp_path):
    """``shard.stage`` 1 and 2 (TensorFlow's stages) train a KerasHub GPT-2 from a config at two
    ranks to the ring's parameters after 4 steps of Adam (seen on 2026-12-06: equal to the
    bit), and the ring's training moved the model."""
    from tests.multirank.conftest import PYTHON, WORKER

    corpus = docs_corpus(tmp_path / "docs")
    common = (f"data.options.root={corpus},model.name=kerashub_causal_lm,model.options={{}},"
              "train.max_steps=4,optim.warmup_steps=0,checkpoint.every_steps=0,"
              "log.console=false,data.batch_size=8")
    proc = horovodrun(2, "gloo", [PYTHON, WORKER, str(tmp_path / "out"),
                                  str(ROOT / "configs" / "lm_tf.yaml"), f"ring:{common}",
                                  f"s1:{common},shard.stage=1", f"s2:{common},shard.stage=2"],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    def parameters(run: str, rank: int) -> dict[str, np.ndarray]:
        with np.load(tmp_path / "out" / run / f"rank{rank}.npz") as npz:
            return dict(npz)

    ring = parameters("ring", 0)
    summary = json.loads((tmp_path / "out" / "ring" / "rank0.json").read_text())["summary"]
    assert summary["final"]["eval_loss"] < math.log(256) - 0.2  # 4 steps moved the model
    for run, stage in (("s1", 1), ("s2", 2)):
        info = json.loads((tmp_path / "out" / run / "rank0.json").read_text())["summary"]
        assert info["shard_stage"] == stage and info["shard_ranks"] == 2
        for rank in (0, 1):
            got = parameters(run, rank)
            assert got.keys() == ring.keys() and len(ring) > 20
            for key, value in ring.items():
                np.testing.assert_allclose(got[key], value, rtol=0, atol=1e-5,
                                           err_msg=f"{run} rank {rank} {key}")
