"""Turn boto3 and botocore failures into one clear :class:`SnapshotError` each.

Users meet these at ``hotpool snapshot push`` and in a worker's ``/load`` answer, so every
message names the bucket and key and says what to check, and none carries a traceback.
"""

from __future__ import annotations

import botocore.exceptions as bce

from hotpool.worker.snapshot.errors import ObjectNotFoundError, SnapshotError

_MISSING_KEY = {"NoSuchKey", "NotFound", "404"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
    "InvalidClientTokenId",
}
_FORBIDDEN = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled"}
_CREDENTIAL_HINT = "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE"


def s3_error(
    exc: BaseException,
    action: str,
    bucket: str,
    key: str | None,
    endpoint: str | None,
    bucket_request: bool = False,
) -> SnapshotError:
    """The error to raise for ``exc`` met while trying to ``action`` ``s3://bucket/key``;
    ``bucket_request`` says ``exc`` answered a request about the bucket alone (HeadBucket),
    so a bare 404 means the bucket is missing."""
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
    at = f"at {endpoint}" if endpoint else "on AWS S3"
    exc = _root_cause(exc)
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
        return SnapshotError(
            f"cannot {action} {where}: no usable AWS credentials ({exc}); set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run with a role"
        )
    if isinstance(exc, bce.EndpointConnectionError | bce.ConnectTimeoutError):
        return SnapshotError(
            f"cannot {action} {where}: the S3 endpoint {endpoint or ''} is unreachable "
            "(check HOTPOOL_S3_ENDPOINT_URL and the network)"
        )
    if isinstance(exc, bce.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", "?"))
        message = error.get("Message") or code
        if code == "NoSuchBucket" or (bucket_request and code in _MISSING_KEY):
            return SnapshotError(
                f"cannot {action} {where}: S3 bucket {bucket!r} does not exist {at}"
            )
        if code in _MISSING_KEY:
            return ObjectNotFoundError(f"no object {where} {at}")
        if code in _BAD_CREDENTIALS:
            return SnapshotError(
                f"cannot {action} {where}: S3 rejected the credentials ({code}: {message}); "
                + _CREDENTIAL_HINT
            )
        if code in _FORBIDDEN:
            return SnapshotError(
                f"cannot {action} {where}: access denied {at} ({code}); the credentials are "
                f"invalid or lack permission: {_CREDENTIAL_HINT}"
            )
        if code == "PreconditionFailed":
            return SnapshotError(f"{where} changed while it was being read; retry")
        return SnapshotError(f"cannot {action} {where}: S3 answered {code}: {message}")
    return SnapshotError(f"cannot {action} {where}: {type(exc).__name__}: {exc}")


def _root_cause(exc: BaseException) -> BaseException:
    """boto3's transfer manager wraps the botocore error it met; find that one."""
    seen = exc
    while not isinstance(seen, bce.BotoCoreError | bce.ClientError):
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            return exc
        seen = nxt
    return seen
