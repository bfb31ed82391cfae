"""Binding: syscalls (affinity, memory policy, page migration), IRQ and cgroup writes."""
