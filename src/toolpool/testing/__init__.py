"""Tools for testing toolpool and code that uses it: example and misbehaving tools."""
