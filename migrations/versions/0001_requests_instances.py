"""requests and instances

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "requests",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False, server_default=""),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("arrival_time", sa.Float, nullable=False),
        sa.Column("first_token_time", sa.Float, nullable=True),
        sa.Column("finish_time", sa.Float, nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cached_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("stream", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("prefill_instance", sa.String(128), nullable=True),
        sa.Column("decode_instance", sa.String(128), nullable=True),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("e2e_ms", sa.Float, nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index("ix_requests_status", "requests", ["status"])
    op.create_index("ix_requests_arrival_time", "requests", ["arrival_time"])
    op.create_index("ix_requests_status_arrival", "requests", ["status", "arrival_time"])
    op.create_table(
        "instances",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("host", sa.String(200), nullable=False, server_default=""),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("last_heartbeat", sa.Float, nullable=False),
        sa.Column("info", sa.JSON, nullable=False),
    )
    op.create_index("ix_instances_role", "instances", ["role"])


def downgrade() -> None:
    op.drop_index("ix_instances_role", table_name="instances")
    op.drop_table("instances")
    op.drop_index("ix_requests_status_arrival", table_name="requests")
    op.drop_index("ix_requests_arrival_time", table_name="requests")
    op.drop_index("ix_requests_status", table_name="requests")
    op.drop_table("requests")
