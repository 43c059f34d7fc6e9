"""What a known-answer screen runs: the job specs and their deterministic workloads, the
platform signature, golden records, fault injection, and the supervised child process
that runs a job on one device and reports its bits."""
