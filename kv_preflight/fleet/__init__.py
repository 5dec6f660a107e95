"""Fleet records every process shares: pods, engines, leases, load and the index-wide settings."""
