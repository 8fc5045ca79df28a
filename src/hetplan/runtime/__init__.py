"""Running a plan for real: stage modules from the profiled step, worker processes that run each
stage's scheduled actions over torch.distributed (gloo), a local launcher, and measured against
predicted. `support` says what the runtime can run (pure Python, read by the planners)."""
