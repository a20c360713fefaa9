"""Starting servers and keeping them running: the command line, serve, replicas,
tensor-parallel ranks, service files, logs."""
