"""Short digests: the hex prefix of a SHA-256 that plans, caches and checkpoints record to tell two inputs apart.

Sixteen hex digits (64 bits) name a plan's problem, costs and cuts; collisions between the few thousand entries a
cache or a plan history holds are out of reach, and the digest stays short enough to read in a diff.
"""

from __future__ import annotations

import hashlib

__all__ = ["short_digest"]


def short_digest(text: str, digits: int = 16) -> str:
    """The first ``digits`` hex digits of the SHA-256 of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()[:digits]
