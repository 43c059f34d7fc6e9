"""Refuse a kubeconfig file before the Kubernetes client's loader reads it.

The loader parses whatever it is given and fails with AttributeError, TypeError, KeyError,
RecursionError or hangs (a FIFO); screener treats a kubeconfig as hostile input like any other
file: one line naming it and exit 2. Imports yaml, not kubernetes.
"""

from __future__ import annotations

import os
import ssl
import stat
from typing import Any
from urllib.parse import urlsplit

import yaml

from screener.errors import ConfigError

KUBECONFIG_MAX_BYTES = 1024 * 1024


def check_kubeconfig(path: str) -> None:
    """Refuse what the kubeconfig loader would hang on or choke on before it reads the file: not
    a regular file (a FIFO or a device would block or never end), over 1 MiB, not UTF-8, not a
    YAML mapping, or nested deeper than a kubeconfig ever is. One line naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the kubeconfig: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: the kubeconfig is not a regular file")
        if st.st_size > KUBECONFIG_MAX_BYTES:
            raise ConfigError(f"{path}: the kubeconfig is {st.st_size} bytes, more than "
                              f"{KUBECONFIG_MAX_BYTES}")
        data = os.read(fd, KUBECONFIG_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: the kubeconfig is not UTF-8 text (byte {e.start})") from None
    depth = max_depth = 0
    for ch in text:  # flow-style nesting; block style cannot go deep in 1 MiB of sane text
        if ch in "[{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    if max_depth > 32:
        raise ConfigError(f"{path}: the kubeconfig nests {max_depth} levels deep")
    try:
        doc = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"{path}: the kubeconfig is not valid YAML: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the kubeconfig is not a YAML mapping "
                          f"(got {type(doc).__name__})")
    for key in ("clusters", "contexts", "users"):
        items = doc.get(key)
        if items is None:
            continue
        if not isinstance(items, list) or not all(
                isinstance(i, dict) and isinstance(i.get("name"), str)
                and isinstance(i.get(key[:-1]) or {}, dict) for i in items):
            raise ConfigError(f"{path}: kubeconfig {key} must be a list of "
                              f"{{name: ..., {key[:-1]}: {{...}}}} entries")
    for c in doc.get("clusters") or ():
        server = (c.get("cluster") or {}).get("server")
        if server is not None and not isinstance(server, str):
            raise ConfigError(f"{path}: kubeconfig cluster {c['name']!r}: server must be a URL")
    for u in doc.get("users") or ():
        user = u.get("user") or {}
        for key in ("token", "tokenFile", "username", "password", "client-certificate",
                    "client-key", "client-certificate-data", "client-key-data"):
            if user.get(key) is not None and not isinstance(user[key], str):
                raise ConfigError(f"{path}: kubeconfig user {u['name']!r}: {key} must be a string")
        for key in ("exec", "auth-provider"):
            if user.get(key) is not None and not isinstance(user[key], dict):
                raise ConfigError(f"{path}: kubeconfig user {u['name']!r}: {key} must be a mapping")
        if isinstance(user.get("exec"), dict) and not isinstance(user["exec"].get("command"), str):
            raise ConfigError(f"{path}: kubeconfig user {u['name']!r}: exec needs a command")


def check_loaded(cfg: Any, where: str) -> None:
    """Check what a loaded configuration will use: the server URL, and the TLS material it names
    (CA, client certificate and key), so a bad one is refused now, as bad input, instead of
    failing every connection later as if the API server were unreachable."""
    try:
        url = urlsplit(str(cfg.host or ""))
        ok = url.scheme in ("http", "https") and bool(url.hostname)
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{where}: the cluster's server {cfg.host!r} is not an http(s) URL")
    try:
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
        if cfg.cert_file or cfg.key_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file or None)
    except (ssl.SSLError, OSError, ValueError, TypeError) as e:
        what = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError(f"{where}: the TLS certificate or key it names is unusable: {what}") from e
