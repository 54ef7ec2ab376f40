"""ferry: live migration of unmodified training processes between nodes."""

__version__ = "0.1.0"
