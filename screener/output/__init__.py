"""What a person reads: progress on stderr while a command runs, and self-contained HTML reports."""
