"""The known-answer checks that need more than one device in a process group: the
all-reduce known answer and peer training across nodes."""
