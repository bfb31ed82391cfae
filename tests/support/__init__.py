"""Test support: fixture hosts, child programs, daemons, cgroups, the guest."""
