"""The balancer layer: from per-sample costs to a plan (which sample goes to which rank at which step).

* :mod:`~fsdata.balancer.cost`: cost models (sequence length to predicted seconds);
* :mod:`~fsdata.balancer.bubble`: the bubble metric and its proven lower bounds;
* :mod:`~fsdata.balancer.compose`: batch composition (which samples share a global batch);
* partitioners: :mod:`~fsdata.balancer.partition` (LPT reference, round-robin, shuffle),
  :mod:`~fsdata.balancer.partition_fast` (LPT + swap), :mod:`~fsdata.balancer.kk` (Karmarkar-Karp) and
  :mod:`~fsdata.balancer.cpsat` (CP-SAT refinement);
* :mod:`~fsdata.balancer.cost_budget`: the cost-budget batch policy;
* :mod:`~fsdata.balancer.plan`: planning (:func:`~fsdata.balancer.plan.make_plan`), with the plan
  windows in :mod:`~fsdata.balancer.windows`, the setting names and checks in
  :mod:`~fsdata.balancer.policies` and the seeded global batches in :mod:`~fsdata.balancer.order`;
* :mod:`~fsdata.balancer.profile`: the ``fsdata profile`` report.

Imports the base and samples layers only; never reads or writes shards.
"""
