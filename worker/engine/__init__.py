"""The engine: sessions, resume and step planning, sampling, text streaming; no I/O."""
