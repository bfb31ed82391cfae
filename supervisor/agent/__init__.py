"""The node agent: placement for containers the supervisor did not start (issue 31)."""
