"""Running a plan for real: stage modules from the profiled step, worker processes with
torch.distributed.pipelining, a local launcher, and measured against predicted (issue 6)."""
