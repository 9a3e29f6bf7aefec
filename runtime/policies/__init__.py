"""Budget policies: how many prompt tokens may ride along with the decodes, per iteration.

Policies are dataclasses whose fields are their parameters; `parse_policy("static:64")` or
`parse_policy("static:tokens=64")` builds one from the command line. Importing this package
registers every policy and loads nothing beyond the core (numpy and scipy included).
"""

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.policies.cadence import CadencePolicy
from edgeprefill.runtime.policies.dlfp import DLFPPolicy
from edgeprefill.runtime.policies.ppas import PPASPolicy
from edgeprefill.runtime.policies.registry import (
    POLICIES,
    baseline_policies,
    parse_policy,
    policy_usage,
)
from edgeprefill.runtime.policies.static import StaticPolicy, UnlimitedPolicy

# What `edgeprefill run` and `Runtime` use unless told otherwise: the policy benchmarks/history.md
# shows best on this project's workloads (section D), with its targets from the device.
DEFAULT_POLICY = "cadence"

__all__ = [
    "POLICIES",
    "DEFAULT_POLICY",
    "BudgetPolicy",
    "CadencePolicy",
    "DLFPPolicy",
    "PPASPolicy",
    "StaticPolicy",
    "UnlimitedPolicy",
    "baseline_policies",
    "parse_policy",
    "policy_usage",
]
