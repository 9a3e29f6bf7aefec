"""The core: requests, the values that cross an iteration's seams (plan, state, timing), the
backend contract, the scheduler, the engine and the policy interface. It imports nothing
from the rest of edgeprefill, so policies and backends can be loaded with it alone."""
