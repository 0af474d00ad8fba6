"""gateway: the HTTP face of specstream (OpenAI-compatible server) and the `specstream` CLI."""
