"""The one exception tree of metanode.

Every rejection the node can give is a subclass of `MetanodeError` carrying its HTTP status, a
stable machine-readable slug and whether retrying can help. The API renders all of them through
one handler into the envelope `{"error": slug, "message": text, "retryable": bool}` (plus any
`extra` fields), so a client can switch on the slug and never parse prose.

The tree, by family:

* `ClaimError` (400): one claim broke a rule of SPEC §2.2 (`invalid_uid`, `invalid_cid`, ...).
* `SignerPolicyError` (403): the claim is well formed but its signer may not make it.
* `RequestError` (400/413): the request itself is malformed or too large.
* `NotFoundError` (404): nothing is known under that name.
* `AuthError` (401): the perimeter token is missing or wrong.
* `UnavailableError` (503): the node cannot answer right now; retrying helps.
"""

from __future__ import annotations

from typing import Any, ClassVar


class MetanodeError(Exception):
    """Base of every error the node reports to a caller."""

    status: ClassVar[int] = 400
    slug: ClassVar[str] = "bad_request"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def envelope(self) -> dict[str, Any]:
        """The JSON body of this error: the envelope plus any extra fields."""
        return {"error": self.slug, "message": self.message, "retryable": self.retryable,
                **self.extra}


# -- one claim is invalid (SPEC §2.2) ------------------------------------------------------------


class ClaimError(MetanodeError):
    """A claim (or an identifier inside one) breaks a validation rule."""


class InvalidClaim(ClaimError):
    slug = "invalid_claim"


class InvalidUid(ClaimError):
    slug = "invalid_uid"


class InvalidCid(ClaimError):
    slug = "invalid_cid"


class NoncanonicalCid(ClaimError):
    """A CID spelled other than CIDv1 base32 lower; `canonical` names the right spelling."""

    slug = "noncanonical_cid"


class InvalidKey(ClaimError):
    slug = "invalid_key"


class ReservedKey(ClaimError):
    slug = "reserved_key"


class InvalidMemberCid(ClaimError):
    slug = "invalid_member_cid"


class InvalidValue(ClaimError):
    slug = "invalid_value"


class InvalidTs(ClaimError):
    slug = "invalid_ts"


class TsInFuture(ClaimError):
    slug = "ts_in_future"
    retryable = True


class BadSignature(ClaimError):
    slug = "bad_signature"


class InvalidRid(ClaimError):
    slug = "invalid_rid"


# -- the signer may not make this claim ---------------------------------------------------------


class SignerPolicyError(MetanodeError):
    status = 403
    slug = "forbidden"


class UnknownSigner(SignerPolicyError):
    slug = "unknown_signer"


class BlockedSigner(SignerPolicyError):
    slug = "blocked_signer"


class LinkNotPermitted(SignerPolicyError):
    slug = "link_not_permitted"


# -- the request as a whole ---------------------------------------------------------------------


class RequestError(MetanodeError):
    slug = "bad_request"


class InvalidJson(RequestError):
    slug = "invalid_json"


class InvalidRequest(RequestError):
    slug = "invalid_request"


class InvalidCursor(RequestError):
    """A feed cursor (`Last-Event-ID`, `?since=`) that is not `<epoch>-<seq>`."""

    slug = "invalid_cursor"


class InvalidBatch(RequestError):
    """At least one claim of a batch failed; `items` lists each failure and nothing was written."""

    slug = "invalid_batch"

    def __init__(self, items: list[dict[str, Any]], status: int = 400,
                 total: int | None = None) -> None:
        """`total` counts every failure when `items` keeps only the first of them."""
        self.total = len(items) if total is None else total
        super().__init__(f"{self.total} claim(s) rejected; nothing was written", items=items)
        self.items = items
        self.status = status  # type: ignore[misc]  # 400, or 403 when only signer policy failed


class TooLarge(RequestError):
    status = 413
    slug = "too_large"


class InvalidKeyFile(RequestError):
    slug = "invalid_key_file"


class DeprecatedField(RequestError):
    """A MetaMesh `/meta` write of a removed per-algorithm CID field (`cid_*`, `midhash256`,
    `canonical_cid`); the writer should send `cids/<cid>` = "true" instead (docs/compat.md)."""

    slug = "deprecated_field"


# -- nothing under that name --------------------------------------------------------------------


class NotFoundError(MetanodeError):
    status = 404
    slug = "not_found"


class UnknownCid(NotFoundError):
    slug = "unknown_cid"


class UnknownRid(NotFoundError):
    slug = "unknown_rid"


class Merged(NotFoundError):
    """The rid was merged into an older one; `survivor` names it."""

    slug = "merged"


class UnknownSignerUid(NotFoundError):
    slug = "unknown_signer"


class MethodNotAllowed(MetanodeError):
    status = 405
    slug = "method_not_allowed"


# -- perimeter ----------------------------------------------------------------------------------


class Unauthorized(MetanodeError):
    status = 401
    slug = "unauthorized"


# -- the node cannot answer now -----------------------------------------------------------------


class UnavailableError(MetanodeError):
    status = 503
    slug = "unavailable"
    retryable = True


class CacheNotReady(UnavailableError):
    slug = "cache_not_ready"


class ShuttingDown(UnavailableError):
    slug = "shutting_down"


class MidhashError(MetanodeError):
    """A file could not be fingerprinted (it shrank or vanished while being read)."""

    slug = "midhash_failed"
    retryable = True
