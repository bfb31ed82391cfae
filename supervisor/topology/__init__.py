"""Host discovery: readers through HostFS and pure parsers, into `Topology`."""
