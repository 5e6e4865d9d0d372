"""load_samples: per-instance load and KV activity over time; request phase timestamps

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_COUNTS = ("blocks_stored", "blocks_evicted", "disk_stored", "disk_removed", "transfers_in",
           "transfers_out")


def upgrade() -> None:
    op.create_table(
        "load_samples",
        sa.Column("instance_id", sa.String(128), primary_key=True),
        sa.Column("t", sa.Float, primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("interval_s", sa.Float, nullable=True),
        *(sa.Column(name, sa.Integer, nullable=False, server_default="0")
          for name in ("queue_depth", "running", "kv_blocks_used", "kv_blocks_free",
                       "kv_blocks_cached", "disk_blocks_used", "disk_blocks_free")),
        *(sa.Column(name, sa.Integer, nullable=True) for name in _COUNTS),
        sa.Column("bytes_in", sa.BigInteger, nullable=True),
        sa.Column("bytes_out", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_load_samples_t", "load_samples", ["t"])
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("dispatch_time", sa.Float, nullable=True))
        batch.add_column(sa.Column("decode_first_token_time", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("decode_first_token_time")
        batch.drop_column("dispatch_time")
    op.drop_index("ix_load_samples_t", table_name="load_samples")
    op.drop_table("load_samples")
