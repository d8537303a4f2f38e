"""``pipeline``: the model cut into stages, data-parallel copies of the pipeline
(``pipeline.stages`` > 1, docs/pipeline.md). Its row of the compatibility table; the checks of
its own values stay with its schedules (:func:`hvdtrain.pipeline.schedules.check_pipeline`)."""

from __future__ import annotations

from typing import Any

from hvdtrain.strategies.base import STAGE_PARTS, CheckpointLayout, Rule, Strategy

TWO = {"pipeline.stages": 2}
"""The smallest pipeline, for the examples."""

TENSORFLOW_SCHEDULES = ("gpipe", "1f1b")
"""The ``pipeline.schedule`` values the TensorFlow stages run (they run the core's action lists,
written for one piece a rank); every other schedule is PyTorch's only (the schedules' own
``frameworks``, :data:`hvdtrain.pipeline.schedules.SCHEDULES`, agree: a unit test checks)."""


def schedule_refused(schedule: str, framework: str) -> str:
    """The one-line reason ``framework`` does not run ``schedule`` with stages."""
    return (f"pipeline.schedule={schedule!r}: runs with PyTorch only; with {framework} use one "
            f"of {', '.join(TENSORFLOW_SCHEDULES)}")


def _given(cfg: Any) -> str:
    return f"pipeline.stages={cfg.pipeline.stages}"


def _precision(cfg: Any) -> str:
    return (f"train.precision={cfg.train.precision!r} with {_given(cfg)}: pipeline stages train "
            "in fp32 only")


RULES = (
    Rule("pipeline", "tensorflow",
         lambda cfg: cfg.framework != "torch" and cfg.pipeline.schedule not in TENSORFLOW_SCHEDULES,
         lambda cfg: schedule_refused(cfg.pipeline.schedule, cfg.framework),
         {**TWO, "framework": "tensorflow", "pipeline.schedule": "interleaved_1f1b",
          "pipeline.virtual_stages": 2},
         only="with schedules other than " + " and ".join(TENSORFLOW_SCHEDULES)),
    Rule("pipeline", "elastic", lambda cfg: cfg.elastic.enabled,
         lambda cfg: f"elastic.enabled=true with {_given(cfg)}: elastic mode does not work with "
                     "pipeline stages (a lost rank breaks its whole pipeline); set "
                     "elastic.enabled=false or pipeline.stages=1",
         {**TWO, "elastic.enabled": True}),
    Rule("pipeline", "accumulation", lambda cfg: cfg.train.backward_passes_per_step > 1,
         lambda cfg: f"train.backward_passes_per_step={cfg.train.backward_passes_per_step} with "
                     f"{_given(cfg)}: a pipeline accumulates over pipeline.microbatches; set it "
                     "to 1",
         {**TWO, "train.backward_passes_per_step": 2}),
    Rule("pipeline", "fp16", lambda cfg: cfg.train.precision == "fp16", _precision,
         {**TWO, "train.precision": "fp16"}),
    Rule("pipeline", "bf16", lambda cfg: cfg.train.precision == "bf16", _precision,
         {**TWO, "train.precision": "bf16"}),
    Rule("pipeline", "sync_batchnorm", lambda cfg: cfg.model.sync_batchnorm,
         lambda cfg: f"model.sync_batchnorm=true with {_given(cfg)}: not supported with pipeline "
                     "stages",
         {**TWO, "model.sync_batchnorm": True}),
    Rule("pipeline", "ps", lambda cfg: cfg.comm.topology != "ring",
         lambda cfg: f"comm.topology={cfg.comm.topology!r} with {_given(cfg)}: pipeline stages "
                     "average within Horovod process sets; parameter servers need "
                     "pipeline.stages=1",
         {**TWO, "comm.topology": "ps"}),
)

STRATEGY = Strategy(
    name="pipeline",
    summary="the model cut into stages, data-parallel copies of the pipeline "
            "(`pipeline.stages` > 1)",
    active=lambda cfg: cfg.pipeline.stages > 1,
    rules=RULES,
    engines={"torch": "hvdtrain.torch.pipeline:PipelineEngine",
             "tensorflow": "hvdtrain.tensorflow.pipeline:PipelineEngine"},
    # No exchange of its own: each stage runs the ring's kinds among its copies (".stage" roles).
    checkpoint=CheckpointLayout(STAGE_PARTS, "each stage's first copy", "no state (an "
                                "allgather carries the parts' names and hashes to rank 0)", True),
    cost="hvdtrain.plan.predict:pipelines",
)
