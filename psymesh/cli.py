"""Console entry point: `psymesh` (see psymesh.node.cli for the commands)."""
from psymesh.node.cli import main

__all__ = ["main"]
