"""`specstream bench serve`: a load generator for any OpenAI-compatible server, its prompt sets and plots."""
