"""Whether the Hugging Face hub can answer, asked once and quickly, before transformers would retry.

Offline, `from_pretrained` of a hub id retries its requests for about half a minute and logs a line
per retry before it fails; `ffkv.models.loading` asks here first and, when the hub cannot be reached,
reads the local cache only (one clear line if the model is not there).
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

#: Seconds to wait for the hub's TCP handshake.
TIMEOUT = 3.0
_TRUE = ("1", "true", "yes", "on")


def endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT``, as huggingface_hub reads it, else huggingface.co."""
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT)
    except Exception:  # noqa: BLE001 - huggingface_hub missing or changed: its documented default
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def offline_mode() -> bool:
    """The user asked for no network (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def reachable(timeout: float = TIMEOUT) -> bool:
    """Whether the hub's host accepts a TCP connection within `timeout` seconds (False in offline mode)."""
    if offline_mode():
        return False
    url = urlparse(endpoint())
    if not url.hostname:
        return False
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def in_cache(name: str) -> bool:
    """Whether the local Hugging Face cache holds the config of hub id `name`."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id, or no huggingface_hub: not in the cache
        return False
    return isinstance(found, str)
