"""Folders a training run writes into (`checkpoint.dir`, the run directory), checked before
any rank starts: a folder that cannot be written would otherwise let the run train to its first
save and lose it there."""
from __future__ import annotations

import os
import tempfile

from hcp.config.errors import ConfigError


def check_writable(key: str, path: str) -> None:
    """`path` (the value of config key `key`) is a folder this process can write into, or can
    be created: the nearest existing folder on its path takes a file (created and removed at
    once; nothing else is made, so a run that fails later leaves no folder behind).

    Raises:
        ConfigError: a file stands where a folder of the path should be, or the nearest
            existing folder refuses a new file (permissions, a read-only file system).
    """
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    fix = f"set {key} to a folder this user can write (it is created if missing)"
    if not os.path.isdir(existing):
        raise ConfigError(key, path,
                          f"{existing} is a file, not a folder, so nothing can be saved there", fix)
    try:
        fd, probe = tempfile.mkstemp(prefix=".hcp-write-check-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(key, path, f"cannot write into {existing} ({e.strerror})", fix) from None
