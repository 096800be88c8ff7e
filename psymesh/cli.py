"""Console entry point: `psymesh` (see psymesh.node.cli.main for the commands)."""
from .node.cli.main import main

__all__ = ["main"]
