"""Library messages name parameters as Python does, in backquotes; a command-line user gets
the flag that sets each."""

from __future__ import annotations

import re

# Parameters whose flag is not their name with dashes.
RENAMED = {"n_threads": "--threads"}


def flag(name: str) -> str:
    return RENAMED.get(name, "--" + name.replace("_", "-"))


def as_flags(message: str) -> str:
    """`n_ctx` -> --n-ctx in an error message, for the names a command line sets."""
    known = {
        "model",
        "policy",
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "n_seq_max",
        "n_threads",
        "max_decode_group",
    }
    return re.sub(r"`(\w+)`", lambda m: flag(m[1]) if m[1] in known else m[0], message)
