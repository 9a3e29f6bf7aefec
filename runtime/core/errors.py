"""Errors a user can fix.

A `UserError` is bad input (a missing model, a malformed workload, an impossible option).
The CLI prints its message on one line and exits with code 2, without a traceback; every
message says what was wrong, where, and how to fix it.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, reported as one line and exit code 2."""
