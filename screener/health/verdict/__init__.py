"""What the node's health readings mean (pure: no I/O, no vendor library): the snapshots, the Xid
catalog, the rules that turn snapshots into Findings, and idle detection."""
