"""Test support: tiny models built from configs, runs built by the real pipeline, a browser."""
