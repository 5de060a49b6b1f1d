"""What rank 0 alone does each step: the scheduled chunks planned into a ``StepPlan``
(``planner.py``), the LoRA adapters held and matched to the step's rows (``adapters.py``), the
sampled tokens (``sampler.py``), a reranker's scores (``score_head.py``)."""
