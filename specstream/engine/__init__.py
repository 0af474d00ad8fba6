"""The engine: the step loop (Engine), its construction (builder), AsyncEngine, the scheduler and a request's state."""
