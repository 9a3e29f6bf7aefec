"""Cadence, split by concern: the cost model's online fit (`fit`), the tail margins
(`margins`), the background's share credit (`share`), a foreground prompt's first-token floor (`floor`),
and the policy that asks each once per iteration (`policy`)."""

from edgeprefill.runtime.policies.cadence.policy import CadencePolicy

__all__ = ["CadencePolicy"]
