"""Engine worker: one serving instance (executor, paged KV pool, prefix/session cache, scheduler)."""
