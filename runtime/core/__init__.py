"""What every capability shares: settings, in-process events, the loopback endpoint
helpers, ambient tags (step-independent context such as phase and microbatch), the
process's ranks, and failure counting.  Nothing here imports a capability."""
