"""The key both servers of a pair sign their Lynx control messages with (opt-in,
``--lynx-auth-key-file``): an HMAC-SHA256 over each message's fields, its room and its
reservation's nonce (:mod:`lynx.transfer.protocol` says what each MAC covers).

Without a key the nonce is the only proof that a notice comes from the prefill holding the
offer, and it travels in clear: whoever sees the offer can forge its notices, and anyone who
reaches prefill's control endpoint can send offers. With a key, a message that does not
carry the key's MAC is dropped, whoever sent it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

MAC_NBYTES = 32  # HMAC-SHA256
KEY_ID_NBYTES = 8
NO_KEY = bytes(KEY_ID_NBYTES)
"""The key id of a server that signs nothing."""
_PEERS_LOGGED = 256  # distinct (reason, peer) pairs logged; a forger may claim any peer name


class AuthKey:
    """A shared secret. Its :attr:`key_id` (a MAC of a fixed text, which tells nothing of
    the secret) travels in the handshake, so that two servers with different keys are
    told apart from a forger and refused naming both ids."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("an empty Lynx auth key")
        self._secret = secret
        self.key_id = hmac.digest(secret, b"lynx key id", hashlib.sha256)[:KEY_ID_NBYTES]

    def mac(self, label: bytes, data: bytes) -> bytes:
        """The MAC of message ``label`` (its kind) with content ``data``. The label's length
        leads it, so that no message of one kind reads as another's."""
        return hmac.digest(self._secret, bytes([len(label)]) + label + data, hashlib.sha256)

    def verify(self, label: bytes, data: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.mac(label, data), mac)

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return f"AuthKey(id={self.key_id.hex()})"


class LogOncePerPeer:
    """Logs a warning the first time a (reason, peer) pair is seen, and nothing after that:
    a flood of forged messages must not flood the log. At most ``_PEERS_LOGGED`` pairs are
    remembered (a forger can claim any peer name); later new ones are logged at debug."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._seen: set[tuple[str, str]] = set()

    def __call__(self, reason: str, peer: str, message: str) -> None:
        key = (reason, peer)
        if key in self._seen:
            return
        if len(self._seen) >= _PEERS_LOGGED:
            self._log.debug("Lynx: %s", message)
            return
        self._seen.add(key)
        self._log.warning("Lynx: %s (logged once per peer; counted as %s)", message, reason)
