"""The burn-in: the full sequence around the known-answer rounds (full), the rounds
themselves (rounds) and the last lines it prints (summary)."""
