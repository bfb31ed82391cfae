"""Example hosts that ship with the package. No I/O here.

builder.FakeHost writes a host tree of real Linux-format files under a
directory; hosts.py holds the machine shapes the tests plan on.
"""
