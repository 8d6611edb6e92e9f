"""A secret read from its file again whenever the file changes: the admin token
(--admin-token-file) and the API key (--api-key-file).

Kubernetes updates a mounted Secret in place (an atomic swap of the files
behind a symlink), so a token the operator replaces, for example after
someone deleted the Secret, reaches running pods within the kubelet's sync
period instead of locking the operator out until they restart.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("batchpilot.server")


class TokenFileError(ValueError):
    """The token file cannot be read or is empty."""


class TokenFile:
    def __init__(self, path: Path, what: str = "admin token") -> None:
        """Reads the token now: a file unusable at start is the caller's error to report.
        `what` names the secret in messages (never its value)."""
        self.path = path
        self.what = what
        self._stamp = self._stat()
        self._token = self._read()

    def current(self) -> str:
        """The token in the file; the previous one while the file is missing or unusable."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return self._token
        try:
            token = self._read()
        except TokenFileError as exc:
            log.warning("%s file changed but %s; keeping the previous token", self.what, exc)
        else:
            if token != self._token:
                log.info("%s file %s changed: using the new token", self.what, self.path)
            self._token = token
        self._stamp = stamp
        return self._token

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def _read(self) -> str:
        try:
            token = self.path.read_text().strip()
        except OSError as exc:
            message = f"cannot read {self.what} file {self.path}: {exc.strerror}"
            raise TokenFileError(message) from exc
        if not token:
            raise TokenFileError(f"{self.what} file {self.path} is empty")
        return token
