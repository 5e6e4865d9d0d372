"""kv_replications: the hot-prefix copies the conductor ordered between prefill instances

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-09
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kv_replications",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("prefix_hash", sa.BigInteger, nullable=False),  # signed view of the u64
        sa.Column("blocks", sa.Integer, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("target", sa.String(128), nullable=False),
        sa.Column("heat_rps", sa.Float, nullable=False),
        sa.Column("holders", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
    )
    op.create_index("ix_kv_replications_created", "kv_replications", ["created"])


def downgrade() -> None:
    op.drop_index("ix_kv_replications_created", table_name="kv_replications")
    op.drop_table("kv_replications")
