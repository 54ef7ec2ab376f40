"""Group snapshots: a consistent cut of every member of a group, each image in a buddy node's
memory (docs/recovery.md)."""
