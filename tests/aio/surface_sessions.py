"""Cases of the async surface suite (see surface.py)."""
