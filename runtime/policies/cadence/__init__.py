"""Cadence, split by concern: the cost model's online fit (`fit`), the tail margins
(`margins`), the documents' share credit (`share`), a chat's first-token floor (`floor`),
and the policy that asks each once per iteration (`policy`)."""

from edgeprefill.runtime.policies.cadence.policy import CadencePolicy

__all__ = ["CadencePolicy"]
