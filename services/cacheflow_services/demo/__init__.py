"""`cacheflow demo`: the local cluster, a slice of a real trace replayed per restore policy, and a report."""
