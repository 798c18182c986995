"""Talaria shared library: contracts (``talaria.v1``), subjects, config, clock, hashing, NATS helpers, CLI."""

__version__ = "0.1.0"
