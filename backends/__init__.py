"""Backends run a planned iteration on a device and report its completed duration."""
