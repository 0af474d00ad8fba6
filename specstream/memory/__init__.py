"""KV memory: block ids with reference counts, the preallocated KV pool, and the prefix cache over it."""
