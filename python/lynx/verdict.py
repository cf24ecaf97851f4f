"""What a request's decode may do with its KV, by what has landed: one vocabulary for the
transfer (the receiver's verdict per room) and the verify step (the TP ranks' agreement
on it), so that neither imports the other for it."""

from __future__ import annotations

import enum


class Verdict(enum.Enum):
    WAIT = "wait"
    READY = "ready"  # write the landed bytes into the KV pool
    FAIL = "fail"
