"""Console entry point: `psymesh` (see psymesh.node.cli for the commands)."""
from .node.cli import main

__all__ = ["main"]
