"""Stage workers: one process per pipeline stage, restoring and running its layers."""
