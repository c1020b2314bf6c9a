"""Data movement: bandwidth shaping (NIXL and TCP come with the storage issue)."""
