"""Helpers below every other package: they import nothing of kvsplice."""
