"""``hvdtrain plan``: predict step time, samples/s and scaling efficiency of every setting (the
ring, flat and hierarchical; parameter servers; pipeline stages; each compression method) on a
cluster described in a file, from a profile of the model measured on one rank.

Framework-free: the cluster file (:mod:`~hvdtrain.plan.cluster`), the model profile
(:mod:`~hvdtrain.plan.profile`), the cost of each collective (:mod:`~hvdtrain.plan.costs`), Tensor
Fusion's buckets overlapped with the backward pass (:mod:`~hvdtrain.plan.fusion`), pipeline stages
on the schedules' own simulator (:mod:`~hvdtrain.plan.stages`), the settings and their predictions
(:mod:`~hvdtrain.plan.predict`) and the outputs (:mod:`~hvdtrain.plan.render`, the table and JSON;
:mod:`~hvdtrain.plan.html`, the page). The formulas and their sources: docs/planner.md.
"""
