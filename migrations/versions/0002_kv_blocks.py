"""kv_blocks: cache metadata (which instance holds which block, in which tier)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kv_blocks",
        sa.Column("block_hash", sa.BigInteger, primary_key=True),  # signed view of the u64
        sa.Column("instance_id", sa.String(128), primary_key=True),
        sa.Column("tier", sa.String(8), primary_key=True),
        sa.Column("nbytes", sa.Integer, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("last_access", sa.Float, nullable=False),
        sa.Column("hit_count", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_kv_blocks_instance", "kv_blocks", ["instance_id"])


def downgrade() -> None:
    op.drop_index("ix_kv_blocks_instance", table_name="kv_blocks")
    op.drop_table("kv_blocks")
