"""Talaria services: router, engine, kvstore, telemetry. Each is a package started as `python -m services.<name>`."""
