"""Coordination state shared by the agents (liveness leases, membership, epochs, spare claims)."""
