"""Facts about the device a run ran on (telemetry comes with issue 4)."""
