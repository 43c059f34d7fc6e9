"""The verdict of a known-answer screen: pure functions from the runs' bits and the
references (golden, memory, peers, quorum) to an outcome per device. No process, no
device, no torch: it sits in the pure layer of the import contract."""
