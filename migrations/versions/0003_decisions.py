"""decisions: the conductor's reasons for each placement or rejection

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "decisions",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("policy", sa.String(32), nullable=False),
        sa.Column("prefill_instance", sa.String(128), nullable=True),
        sa.Column("decode_instance", sa.String(128), nullable=True),
        sa.Column("predicted_ttft_ms", sa.Float, nullable=True),
        sa.Column("predicted_tbt_ms", sa.Float, nullable=True),
        sa.Column("rejected", sa.Text, nullable=True),
        sa.Column("candidates", sa.JSON, nullable=False),
    )
    op.create_index("ix_decisions_created", "decisions", ["created"])


def downgrade() -> None:
    op.drop_index("ix_decisions_created", table_name="decisions")
    op.drop_table("decisions")
