"""Example extensions of fw: user callbacks you can copy (run from the repository root)."""
