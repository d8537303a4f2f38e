"""Horovod's Keras API and SyncBatchNormalization on Keras 3, checked at 2 ranks.

Run by tests/horovod/test_keras3.py as `horovodrun -np 2 python keras3_worker.py`. Each check asserts
values computed from rank and size and prints `ok NAME`; the Keras 3 counterparts of the Horovod tests
that tests/horovod/known_artifacts.txt lists as Keras 2-only.
"""

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf


def check_sync_batch_norm() -> None:
    """SyncBatchNormalization on each rank's row equals BatchNormalization on all ranks' rows."""
    rows = np.stack([np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1]], np.float32)
                     for r in range(hvd.size())])
    reference = tf.keras.layers.BatchNormalization(axis=1)
    synced = hvd_tf.SyncBatchNormalization(axis=1)
    expected = reference(rows, training=True).numpy()[hvd.rank()]
    got = synced(rows[hvd.rank()][None], training=True).numpy()[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(synced.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(synced.moving_variance.numpy(), reference.moving_variance.numpy(),
                               rtol=1e-5)


def small_model(value: float) -> tf.keras.Model:
    """Two Dense layers whose weights all equal `value`."""
    init = tf.keras.initializers.Constant(value)
    model = tf.keras.Sequential([tf.keras.Input(shape=(3,)),
                                 tf.keras.layers.Dense(2, kernel_initializer=init, bias_initializer=init),
                                 tf.keras.layers.Dense(1, kernel_initializer=init, bias_initializer=init)])
    return model


def check_partial_gradient_tape() -> None:
    """Local layers keep their own gradient (divided by size); the others are averaged."""
    model = small_model(float(hvd.rank() + 1))
    x = tf.ones((4, 3))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    local = tape.gradient(loss, model.trainable_weights)
    dtape = hvd_tf.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    grads = dtape.gradient(loss, model.trainable_weights)
    for i, (g, mine) in enumerate(zip(grads, local, strict=True)):
        if i < 2:  # the first layer's kernel and bias are local
            np.testing.assert_allclose(g.numpy(), mine.numpy() / hvd.size(), rtol=1e-5)
        else:
            expected = hvd_tf.allreduce(mine, op=hvd_tf.Average).numpy()
            np.testing.assert_allclose(g.numpy(), expected, rtol=1e-5)
            assert not np.allclose(g.numpy(), mine.numpy())


def check_distributed_optimizer() -> None:
    """One SGD step with DistributedOptimizer moves every rank's weights by the averaged gradient."""
    model = small_model(1.0)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=1.0))
    x = tf.fill((1, 3), float(hvd.rank() + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    grads = tape.gradient(loss, model.trainable_weights)
    before = [w.numpy() for w in model.trainable_weights]
    opt.apply_gradients(zip(grads, model.trainable_weights, strict=True))
    for b, w, g in zip(before, model.trainable_weights, grads, strict=True):
        np.testing.assert_allclose(w.numpy(), b - hvd_tf.allreduce(g, op=hvd_tf.Average).numpy(),
                                   rtol=1e-5)
    assert type(opt).__name__ == "SGD" and opt.get_config()["learning_rate"] == 1.0


def check_fit_callbacks() -> None:
    """model.fit with the broadcast (local variables kept), metric-average and warm-up callbacks."""
    model = small_model(float(hvd.rank()))
    local = list(model.layers[0].trainable_weights)
    lr = 0.01 * hvd.size()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=lr)),
                  loss="mse", jit_compile=False)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=1, local_variables=local),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2)]
    model.layers[0].trainable = False  # so the broadcast's effect on the local layer is visible
    x, y = np.ones((8, 3), np.float32), np.full((8, 1), float(hvd.rank()), np.float32)
    history = model.fit(x, y, batch_size=4, epochs=3, callbacks=callbacks, verbose=0)
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), float(hvd.rank()))
    others = hvd_tf.allgather(tf.constant([[float(v.numpy().sum()) for v in model.layers[1].weights]]))
    np.testing.assert_allclose(others.numpy()[0], others.numpy()[1], rtol=1e-6)
    losses = hvd_tf.allgather(tf.constant([history.history["loss"]], tf.float32)).numpy()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)  # averaged: the same on every rank
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), lr, rtol=1e-5)


def check_elastic_state() -> None:
    """hvd.elastic.KerasState syncs to rank 0 and restores the last commit."""
    model = small_model(float(hvd.rank() + 1))
    model.build((None, 3))
    state = hvd.elastic.KerasState(model, tf.keras.optimizers.Adam(0.001), epoch=hvd.rank())
    state.sync()
    assert state.epoch == 0
    for w in model.get_weights():
        np.testing.assert_allclose(w, 1.0)
    model.set_weights([w * 0 + 5.0 for w in model.get_weights()])
    state.restore()
    for w in model.get_weights():
        np.testing.assert_allclose(w, 1.0)


def main() -> None:
    """Runs every check in order; any failed assertion ends the process with an error."""
    hvd.init()
    assert hvd.size() == 2, "run at -np 2"
    for check in (check_sync_batch_norm, check_partial_gradient_tape, check_distributed_optimizer,
                  check_fit_callbacks, check_elastic_state):
        check()
        print(f"ok {check.__name__}", flush=True)


if __name__ == "__main__":
    main()
