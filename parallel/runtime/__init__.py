"""What runs a plan: the launcher environment, the recompute code, DeepSpeed's PipelineModule and engine with
stagecheck's schedules adapted to them, the DeepSpeed config and the learning-rate schedule. The only place,
with parallel/measurement/, that imports DeepSpeed."""
