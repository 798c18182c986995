"""Router: the OpenAI-compatible HTTP API, the session table and placement. It never executes tokens."""
