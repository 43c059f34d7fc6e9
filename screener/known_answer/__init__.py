"""The known-answer engine: job specs and their deterministic workloads, golden records, fault injection,
the screen of each device in a child process, and the comparisons with peers (cross-check, peer training)."""
