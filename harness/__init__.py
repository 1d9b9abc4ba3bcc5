"""One run, from a composed config to its outputs: start-up validation (startup), the run context, the step
loop (trainer), what surrounds each step (run_control: resume, preemption, non-finite steps, checkpoints),
accounting, metrics, W&B, faults and the dry run. A sweep's job differs only through the hooks of `job`."""
