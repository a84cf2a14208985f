"""ffkv: transformer feed-forward layers read as key-value memories (Geva et al. 2021)."""

__version__ = "0.1.0"
