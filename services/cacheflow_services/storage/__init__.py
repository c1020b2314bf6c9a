"""The storage pod: stores and serves chunk objects (FastAPI control API + TCP/NIXL data plane)."""
