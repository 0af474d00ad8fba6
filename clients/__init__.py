"""clients: an httpx SDK for OpenAI-style servers. Speaks HTTP only; imports neither specstream nor gateway."""
