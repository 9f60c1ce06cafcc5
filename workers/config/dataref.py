"""The worker's settings for payloads by reference (``ce_dataref``, docs/contract.md):
which Redis keys and S3 buckets a request may name. A base of ``WorkerSettings``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas import DEFAULT_DATA_PREFIX, parse_dataref


class DatarefSettings(BaseModel):
    """Where a request's ``ce_dataref`` may point."""

    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    dataref_redis_prefix: str = Field(
        default=DEFAULT_DATA_PREFIX,
        min_length=1,
        description="a ce_dataref may name Redis keys (redis:KEY) with this prefix only",
    )
    dataref_s3_buckets: str = Field(
        default="",
        description="comma-separated S3 buckets a ce_dataref may name (s3://BUCKET/KEY); "
        "empty: none (the store is set with the s3_* settings)",
    )

    @field_validator("dataref_s3_buckets")
    @classmethod
    def _check_buckets(cls, value: str) -> str:
        for bucket in _split(value):
            parse_dataref(f"s3://{bucket}/k")  # raises ValueError naming the rule
        return value

    @property
    def s3_buckets(self) -> frozenset[str]:
        """The buckets of ``dataref_s3_buckets``."""
        return frozenset(_split(self.dataref_s3_buckets))


def _split(names: str) -> list[str]:
    return [name.strip() for name in names.split(",") if name.strip()]
