"""One rank's running model: built in one pass (``model_shard.py``: the decoder, its weights,
the compute path, the KV pool, the decode graphs), the step it runs (``step_plan.py``), and the
other tensor-parallel ranks, each a process of its own (``ranks.py``)."""
