"""Pure planning: Topology + settings -> Placement (roles, re-plans, rendering). No I/O."""
