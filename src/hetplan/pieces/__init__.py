"""A training step cut into pieces, and what both the profiler and the runtime need to run them:
the cut (`split`, after tracing the step: `tracing`), pieces made device-neutral (`portable`), a
stage's optimizer (`optim`) and the host allocator's setting (`hostmem`). The profiler times these
pieces and the runtime trains with them, so they live below both."""
