"""The gateway's side of the mesh: its inbox for outputs, the Redis registry, fan-out to every
replica, dependency health, replicas, discovery and membership, load and routing."""
