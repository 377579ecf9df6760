"""SQLAlchemy models of the ledger: tenants, API keys, deployments, prices, usage and scale
events, and the hourly usage rollups.

The Alembic migrations in ``hotpool.migrations.versions`` are written by hand and must agree
with these models; ``tests/billing/test_migrations.py`` checks that they do. Constraint names
come from the naming convention below, so a migration names them the same way on every
database.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUSES = ("completed", "partial", "error", "cancelled")
DTYPES = ("bf16", "fp16", "fp32")
# How a deployment's replicas hold their linear weights: in the activation dtype ("none"),
# int8 per output channel made at load ("int8"), or the GGUF's own blocks as kept ("gguf").
QUANTIZATIONS = ("none", "int8", "gguf")
DEFAULT_TENANT_ID = 1

# SQLite only auto-increments an INTEGER PRIMARY KEY; BIGINT would need explicit ids.
BigIntPK = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware datetime stored as UTC.

    PostgreSQL keeps ``timestamptz``; SQLite has no time zones, so values are stored as naive
    UTC and get ``tzinfo=UTC`` back when read. Naive datetimes are refused on the way in: a
    naive value is ambiguous and would silently shift usage between buckets.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value.isoformat()} given; use a UTC-aware one")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class ApiKey(Base):
    """An API key of a tenant. The key itself is never stored, only its SHA-256 digest.

    ``prefix`` is the key's visible start ("hp_" and 8 characters): unique, so a presented
    key is found by its prefix and then checked against ``key_hash``, and listings can name
    a key without revealing it. ``scopes`` is a comma-separated list in sorted order.
    """

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str | None] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16), unique=True, index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Deployment(Base):
    """A deployment's settings. The optional ones are NULL for "the default": the server's
    (``max_queue``, ``queue_timeout_s``, ``kv_cache_bytes``) or the snapshot's (``dtype``,
    ``max_model_len``). ``generation`` goes up by one whenever what the replicas run changes,
    so replicas started from an older one can be told apart and replaced.
    """

    __tablename__ = "deployments"
    __table_args__ = (
        CheckConstraint("min_replicas >= 0", name="min_replicas_nonnegative"),
        CheckConstraint("max_replicas >= 1", name="max_replicas_positive"),
        CheckConstraint("max_replicas >= min_replicas", name="max_replicas_ge_min"),
        CheckConstraint("target_concurrency >= 1", name="target_concurrency_positive"),
        CheckConstraint("idle_timeout_s >= 0", name="idle_timeout_nonnegative"),
        # A CHECK on NULL is unknown, which passes: NULL stays allowed in the nullable ones.
        CheckConstraint("max_queue >= 1", name="max_queue_positive"),
        CheckConstraint("queue_timeout_s > 0", name="queue_timeout_positive"),
        CheckConstraint("dtype IN ('bf16', 'fp16', 'fp32')", name="dtype_valid"),
        CheckConstraint("quantization IN ('none', 'int8', 'gguf')", name="quantization_valid"),
        CheckConstraint("max_model_len >= 16", name="max_model_len_min"),
        CheckConstraint("kv_cache_bytes >= 1048576", name="kv_cache_bytes_min"),
        CheckConstraint("default_max_tokens >= 1", name="default_max_tokens_positive"),
        CheckConstraint("max_tokens_limit >= 1", name="max_tokens_limit_positive"),
        CheckConstraint("generation >= 1", name="generation_positive"),
        CheckConstraint(
            "canary_percent >= 0 AND canary_percent <= 100", name="canary_percent_range"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    snapshot_uri: Mapped[str] = mapped_column(Text)
    min_replicas: Mapped[int] = mapped_column(Integer, default=0)
    max_replicas: Mapped[int] = mapped_column(Integer, default=1)
    target_concurrency: Mapped[int] = mapped_column(Integer, default=8)
    idle_timeout_s: Mapped[float] = mapped_column(Float, default=300.0)
    max_queue: Mapped[int | None] = mapped_column(Integer)
    queue_timeout_s: Mapped[float | None] = mapped_column(Float)
    dtype: Mapped[str | None] = mapped_column(String(8))
    quantization: Mapped[str] = mapped_column(String(8), default="none", server_default="none")
    speculative: Mapped[str | None] = mapped_column(Text)  # the policy's JSON; NULL: none
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    kv_cache_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # An answer's length: what a request without max_tokens gets, and the most one may ask
    # for (NULL: up to the context). Not a version's: the control plane applies them.
    default_max_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens_limit: Mapped[int | None] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Versions (see DeploymentVersion): ``generation`` is the stable version's number; a
    # canary version takes ``canary_percent`` of the requests; ``previous_version`` is the
    # stable version before the last promote, roll-out or rollback (what a rollback restores).
    canary_version: Mapped[int | None] = mapped_column(Integer)
    canary_percent: Mapped[float | None] = mapped_column(Float)
    previous_version: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class DeploymentVersion(Base):
    """An immutable, numbered version of what a deployment's replicas run: a snapshot and
    engine options. Every change of those creates one; who made it, when and what changed
    (JSON ``{"field": [old, new]}``) are kept. Removed with the deployment."""

    __tablename__ = "deployment_versions"
    __table_args__ = (
        UniqueConstraint("deployment_id", "version"),
        CheckConstraint("version >= 1", name="version_positive"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment_id: Mapped[int] = mapped_column(ForeignKey("deployments.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    snapshot_uri: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str | None] = mapped_column(String(8))
    quantization: Mapped[str] = mapped_column(String(8), default="none", server_default="none")
    speculative: Mapped[str | None] = mapped_column(Text)
    max_model_len: Mapped[int | None] = mapped_column(Integer)
    kv_cache_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(64))
    changes: Mapped[str | None] = mapped_column(Text)


class Price(Base):
    """What a deployment's tokens cost from ``effective_from`` on, until the next price.

    Amounts are integer micro-units of ``currency`` per million tokens ($0.15 per 1M input
    tokens is ``input = 150000``); ``cached_input`` is the price of prompt tokens served from
    the prefix cache, ``input`` that of the rest. ``deployment`` NULL is the default price of
    every deployment without one of its own. Rows are never changed: a new price is a new
    row, so the price any past event was billed at stays readable.
    """

    __tablename__ = "prices"
    __table_args__ = (
        CheckConstraint("input >= 0", name="input_nonnegative"),
        CheckConstraint("cached_input >= 0", name="cached_input_nonnegative"),
        CheckConstraint("output >= 0", name="output_nonnegative"),
        CheckConstraint("length(currency) = 3 AND upper(currency) = currency", name="currency_iso"),
        UniqueConstraint("deployment", "effective_from"),
        # NULLs are distinct in a unique constraint, so the default prices need their own.
        Index(
            "uq_prices_default_effective_from",
            "effective_from",
            unique=True,
            sqlite_where=text("deployment IS NULL"),
            postgresql_where=text("deployment IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    deployment: Mapped[str | None] = mapped_column(String(128))
    currency: Mapped[str] = mapped_column(String(3))
    input: Mapped[int] = mapped_column(BigInteger)
    cached_input: Mapped[int] = mapped_column(BigInteger)
    output: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime())
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class UsageEvent(Base):
    """One request's billable usage. Append-only; ``request_id`` makes a replay a no-op.

    ``cost_micros`` is computed at ingest with the price in force at ``created_at`` (NULL:
    no price was). A correction is a row of its own whose ``corrects_id`` is the id of the
    event it corrects and whose counts and cost are deltas, so they alone may be negative:
    sums over the rows of a request give its corrected usage.
    """

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint(
            "status IN ('completed', 'partial', 'error', 'cancelled')", name="status_valid"
        ),
        CheckConstraint(
            "corrects_id IS NOT NULL OR prompt_tokens >= 0", name="prompt_tokens_nonnegative"
        ),
        CheckConstraint(
            "corrects_id IS NOT NULL OR cached_tokens >= 0", name="cached_tokens_nonnegative"
        ),
        CheckConstraint(
            "corrects_id IS NOT NULL OR completion_tokens >= 0",
            name="completion_tokens_nonnegative",
        ),
        CheckConstraint(
            "corrects_id IS NOT NULL OR cached_tokens <= prompt_tokens", name="cached_le_prompt"
        ),
        CheckConstraint("corrects_id IS NOT NULL OR cost_micros >= 0", name="cost_nonnegative"),
        CheckConstraint("(cost_micros IS NULL) = (currency IS NULL)", name="cost_has_currency"),
        # Usage queries filter by deployment and time range.
        Index(None, "deployment", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    # The key that made the request (None without auth); no foreign key: usage outlives keys.
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    # The name, not a foreign key: usage outlives the deployment it was served by.
    deployment: Mapped[str] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    queue_seconds: Mapped[float | None] = mapped_column(Float)
    ttft_seconds: Mapped[float | None] = mapped_column(Float)
    total_seconds: Mapped[float | None] = mapped_column(Float)
    cold_start: Mapped[bool] = mapped_column(default=False)
    error: Mapped[str | None] = mapped_column(Text)
    # The x-request-id the client sent, kept to correlate with its logs; not unique, and
    # not the ledger's key: that is the server-minted ``request_id``.
    client_request_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    # Integer micro-units of ``currency``; NULL (both) when no price was in force.
    cost_micros: Mapped[int | None] = mapped_column(BigInteger)
    currency: Mapped[str | None] = mapped_column(String(3))
    # The event a correction row corrects (an id of this table; no foreign key, as the
    # ledger is append-only), and why it was corrected.
    corrects_id: Mapped[int | None] = mapped_column(BigInteger, index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    # The deployment version that served the request (None: before versions existed).
    version: Mapped[int | None] = mapped_column(Integer)


class ScaleEvent(Base):
    """One autoscaler decision to change a deployment's replica count.

    Kept so operators can see why and how fast a deployment scaled. A scale-up's
    ``cold_start_seconds`` (or ``error``) is filled in later, once the replica is ready or
    its start failed.
    """

    __tablename__ = "scale_events"
    __table_args__ = (
        CheckConstraint("from_replicas >= 0", name="from_replicas_nonnegative"),
        CheckConstraint("to_replicas >= 0", name="to_replicas_nonnegative"),
        CheckConstraint("from_replicas <> to_replicas", name="replicas_changed"),
        CheckConstraint("cold_start_seconds >= 0", name="cold_start_seconds_nonnegative"),
        # "The latest events of a deployment" and counts since a time filter on both.
        Index(None, "deployment", "created_at"),
        # The dashboard: a tenant's events over a time range.
        Index(None, "tenant_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    # The name, not a foreign key: the history outlives a deleted deployment.
    deployment: Mapped[str] = mapped_column(String(128))
    from_replicas: Mapped[int] = mapped_column(Integer)
    to_replicas: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(256))
    cold_start_seconds: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # The tenant owning the deployment when the event happened (None: unknown, as for
    # events recorded before revision 0007 whose deployment was gone by then).
    tenant_id: Mapped[int | None] = mapped_column(Integer)
    # The cold start's phases as JSON text, {"fetch": 0.4, "load": 0.2, ...}.
    phases: Mapped[str | None] = mapped_column(Text)


class UsageRollupHourly(Base):
    """Sums of the usage events of one UTC hour, tenant and deployment.

    Derived data: :mod:`hotpool.billing.rollups` deletes and recomputes it from
    ``usage_events``, which stay the truth. The sums follow :mod:`hotpool.billing.usage`:
    token sums include correction rows (so they are corrected totals), ``requests`` leaves
    them out, and ``cost_micros`` sums the costs of the priced events (NULL, with
    ``currency``, when none of the group's events had a price in force).
    """

    __tablename__ = "usage_rollups_hourly"
    __table_args__ = (
        PrimaryKeyConstraint("hour", "tenant_id", "deployment"),
        CheckConstraint("requests >= 0", name="requests_nonnegative"),
        CheckConstraint("(cost_micros IS NULL) = (currency IS NULL)", name="cost_has_currency"),
    )

    # The start of the UTC hour.
    hour: Mapped[datetime] = mapped_column(UTCDateTime())
    # No foreign key: like usage_events.deployment, a rollup outlives what it names.
    tenant_id: Mapped[int] = mapped_column(Integer)
    deployment: Mapped[str] = mapped_column(String(128))
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int | None] = mapped_column(BigInteger)
    currency: Mapped[str | None] = mapped_column(String(3))
    rebuilt_at: Mapped[datetime] = mapped_column(UTCDateTime())
