"""The node lifecycle: the pure state machine, its policy (lemon rule, quarantine budget) and the
transition records every store persists."""
