"""Whether the Hugging Face Hub can be reached, asked once with a short timeout.

`datasets` and `huggingface_hub` retry an unreachable Hub for tens of seconds (five tries, waiting 1, 2,
4, 8 and 8 s) before they give up; one TCP connection to the Hub (or to the proxy that reaches it) with
a 5 s timeout says the same at once. `data.dataset_name` and lm-eval tasks whose data is on the Hub
both ask here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")


def offline_mode_set() -> bool:
    """Whether the user asked for the cache only (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE):
    then nothing is probed and the libraries read their caches."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


def hub_endpoint() -> tuple[str, str, int]:
    """(scheme, host, port) of the Hub the libraries talk to: HF_ENDPOINT, else huggingface.co."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    scheme = "http" if endpoint.scheme == "http" else "https"
    return scheme, endpoint.hostname or "huggingface.co", endpoint.port or (80 if scheme == "http" else 443)


def hub_unreachable() -> str | None:
    """None when a TCP connection to the Hub opens within PROBE_TIMEOUT_S, else where it was dialled and why
    it failed (one line).
    Behind a proxy (HTTPS_PROXY / HTTP_PROXY, not bypassed by NO_PROXY) the proxy is what is dialled:
    the Hub's own address may well be unreachable from here."""
    scheme, host, port = hub_endpoint()
    target = (host, port)
    proxy = urllib.request.getproxies().get(scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        parsed = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        if parsed.hostname:
            target = (parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80))
    try:
        socket.create_connection(target, timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        via = f" through the proxy {target[0]}:{target[1]}" if target != (host, port) else ""
        return f"{host}:{port}{via}: {exc.strerror or exc or type(exc).__name__}"
    return None


@contextlib.contextmanager
def cache_only_while_hub_unreachable() -> Iterator[str | None]:
    """While the Hub cannot be reached (and the user has not set offline mode), `datasets` and
    `huggingface_hub` read their caches only, as with HF_HUB_OFFLINE=1: a dataset in the cache loads, one
    that is not fails at once instead of after the libraries' retries. Yields why the Hub is unreachable,
    or None (online, or offline mode set by the user: nothing changed)."""
    why = None if offline_mode_set() else hub_unreachable()
    if why is None:
        yield None
        return
    import datasets.config
    import huggingface_hub.constants

    # Both libraries read HF_HUB_OFFLINE from the environment at import; these are the values they consult.
    flags = [(huggingface_hub.constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE")]
    flags += [(datasets.config, "HF_DATASETS_OFFLINE")] if hasattr(datasets.config, "HF_DATASETS_OFFLINE") else []
    saved = [(module, name, getattr(module, name)) for module, name in flags]
    try:
        for module, name in flags:
            setattr(module, name, True)
        yield why
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
