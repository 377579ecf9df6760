"""API keys: created for a tenant with scopes, shown once, stored only as a SHA-256 digest.

A key is ``hp_`` and 40 random letters and digits (about 238 bits). Its first 11 characters,
the *prefix*, are stored in clear and are unique: they find the key's row and name the key
in listings and logs. The whole key is checked against the stored digest in constant time.
The key itself is returned once by :meth:`KeyStore.create` and never stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from hotpool.billing.db import Database
from hotpool.billing.models import ApiKey, Tenant, utcnow

# ``admin`` manages its own tenant's keys and has its every scope; ``operator`` runs the
# platform: tenants, and every tenant's keys and usage (every scope, in every tenant).
SCOPES = ("deploy", "invoke", "usage", "admin", "operator")
KEY_START = "hp_"
PREFIX_LEN = len(KEY_START) + 8
KEY_LEN = len(KEY_START) + 40
KEY_NAME_MAX_LEN = 128
# Letters and digits only: a key is one "word" to double-click, and "_" only ever ends "hp_".
_ALPHABET = string.ascii_letters + string.digits
_KEY = re.compile(rf"{KEY_START}[A-Za-z0-9]{{{KEY_LEN - len(KEY_START)}}}")
_PREFIX = re.compile(rf"{KEY_START}[A-Za-z0-9]{{{PREFIX_LEN - len(KEY_START)}}}")
# A clash of two 8-character prefixes is ~1 in 2e14; retrying a few times is plenty.
_CREATE_ATTEMPTS = 5


@dataclass(frozen=True)
class ApiKeyRecord:
    """A stored API key, without the key: its prefix names it."""

    id: int
    tenant_id: int
    name: str | None
    prefix: str
    scopes: frozenset[str]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows(self, scope: str) -> bool:
        """Whether this key may act in ``scope``: ``operator`` allows every scope, ``admin``
        every one but ``operator``, and a revoked key none. ValueError for a scope that does
        not exist, so a typo cannot pass."""
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; scopes are {', '.join(SCOPES)}")
        if not self.active:
            return False
        if scope in self.scopes or "operator" in self.scopes:
            return True
        return "admin" in self.scopes and scope != "operator"


def parse_scopes(text: str) -> frozenset[str]:
    """Scopes from a comma-separated list such as ``"deploy,invoke"``.

    Blanks around names are ignored. ValueError names an unknown scope, or says that none
    was given.
    """
    return check_scopes(part.strip() for part in text.split(",") if part.strip())


def check_scopes(scopes: Iterable[str]) -> frozenset[str]:
    """``scopes`` as a frozenset, if it is not empty and holds only known scopes."""
    result = frozenset(scopes)
    for scope in sorted(result):
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; scopes are {', '.join(SCOPES)}")
    if not result:
        raise ValueError(f"no scopes given; choose from {', '.join(SCOPES)}")
    return result


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _new_key() -> str:
    return KEY_START + "".join(secrets.choice(_ALPHABET) for _ in range(KEY_LEN - len(KEY_START)))


class KeyStore:
    """Creates, checks, lists and revokes API keys in the ``api_keys`` table."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(
        self, tenant_id: int, scopes: str | Iterable[str], name: str | None = None
    ) -> tuple[ApiKeyRecord, str]:
        """A new key of tenant ``tenant_id``: its record and the key itself, shown only now.

        ``scopes`` is a comma-separated string or an iterable of scope names. ValueError for
        bad scopes, a ``name`` longer than 128 characters or an unknown tenant.
        """
        allowed = parse_scopes(scopes) if isinstance(scopes, str) else check_scopes(scopes)
        if name is not None and not 1 <= len(name) <= KEY_NAME_MAX_LEN:
            raise ValueError(f"name must be 1 to {KEY_NAME_MAX_LEN} characters, or none")
        with self.db.session() as session:
            if session.get(Tenant, tenant_id) is None:
                raise ValueError(f"tenant {tenant_id} does not exist")
        for attempt in range(_CREATE_ATTEMPTS):
            key = _new_key()
            row = ApiKey(
                tenant_id=tenant_id,
                name=name,
                prefix=key[:PREFIX_LEN],
                key_hash=_digest(key),
                scopes=",".join(sorted(allowed)),
                created_at=utcnow(),
            )
            try:
                with self.db.session() as session, session.begin():
                    session.add(row)
            except IntegrityError:
                # Only a prefix clash is worth another try; anything else is re-raised.
                if attempt + 1 == _CREATE_ATTEMPTS or self._row(key[:PREFIX_LEN]) is None:
                    raise
                continue
            return _record(row), key
        raise AssertionError("unreachable")

    def authenticate(self, key: str) -> ApiKeyRecord | None:
        """The active key that ``key`` is, or None (malformed, unknown or revoked).

        Never raises for any string: a malformed one is refused before the database sees it.
        """
        if not isinstance(key, str) or len(key) != KEY_LEN or _KEY.fullmatch(key) is None:
            return None
        row = self._row(key[:PREFIX_LEN])
        # Compare digests, not keys, in constant time: timing reveals nothing of the secret.
        if row is None or not hmac.compare_digest(_digest(key), row.key_hash):
            return None
        record = _record(row)
        return record if record.active else None

    def revoke(self, prefix_or_id: str | int, tenant_id: int | None = None) -> ApiKeyRecord:
        """Revoke a key, named by its prefix (or the whole key) or by its id; with
        ``tenant_id``, only a key of that tenant (another's is as unknown).

        Revoking a revoked key changes nothing and returns it as it is. KeyError if there is
        no such key.
        """
        if isinstance(prefix_or_id, int) and not isinstance(prefix_or_id, bool):
            match = ApiKey.id == prefix_or_id
        elif isinstance(prefix_or_id, str) and (
            _PREFIX.fullmatch(prefix_or_id) or _KEY.fullmatch(prefix_or_id)
        ):
            match = ApiKey.prefix == prefix_or_id[:PREFIX_LEN]
        else:
            raise KeyError(prefix_or_id)
        if tenant_id is not None:
            match = match & (ApiKey.tenant_id == tenant_id)
        stmt = update(ApiKey).where(match, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
        with self.db.session() as session, session.begin():
            session.execute(stmt)
            row = session.scalar(select(ApiKey).where(match))
            if row is None:
                raise KeyError(prefix_or_id)
            return _record(row)

    def list(self, tenant_id: int | None = None) -> list[ApiKeyRecord]:
        """Every key, revoked ones too, newest first; optionally only one tenant's."""
        stmt = select(ApiKey).order_by(ApiKey.id.desc())
        if tenant_id is not None:
            stmt = stmt.where(ApiKey.tenant_id == tenant_id)
        with self.db.session() as session:
            return [_record(row) for row in session.scalars(stmt)]

    def touch(self, key_id: int, when: datetime | None = None) -> None:
        """Set the key's ``last_used_at`` to ``when`` (default now), in one UPDATE.

        Callers throttle this (once a minute per key is plenty). KeyError for an unknown id.
        """
        if when is not None and when.utcoffset() is None:
            raise ValueError("when must be timezone-aware")
        stmt = update(ApiKey).where(ApiKey.id == key_id).values(last_used_at=when or utcnow())
        with self.db.engine.begin() as conn:
            result = conn.execute(stmt)
        if result.rowcount == 0:
            raise KeyError(key_id)

    def _row(self, prefix: str) -> ApiKey | None:
        with self.db.session() as session:
            return session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))


def _record(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        name=row.name,
        prefix=row.prefix,
        scopes=frozenset(row.scopes.split(",")),
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )
