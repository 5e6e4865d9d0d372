"""plan_decisions and role_switches: the P/D planner's decisions and engine role switches

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "plan_decisions",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        *(sa.Column(name, sa.Integer, nullable=False)
          for name in ("current_prefill", "current_decode", "best_prefill", "best_decode")),
        sa.Column("switch_instance", sa.String(128), nullable=True),
        sa.Column("switch_from", sa.String(16), nullable=True),
        sa.Column("switch_to", sa.String(16), nullable=True),
        sa.Column("drain_s", sa.Float, nullable=True),
        sa.Column("acted", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("attainment", sa.Float, nullable=True),
        sa.Column("forecast", sa.JSON, nullable=False),
        sa.Column("instances", sa.JSON, nullable=False),
        sa.Column("estimates", sa.JSON, nullable=False),
    )
    op.create_index("ix_plan_decisions_created", "plan_decisions", ["created"])
    op.create_table(
        "role_switches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("instance_id", sa.String(128), nullable=False),
        sa.Column("from_role", sa.String(16), nullable=False),
        sa.Column("to_role", sa.String(16), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("requested_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("drain_s", sa.Float, nullable=True),
        sa.Column("detail", sa.Text, nullable=True),
    )
    op.create_index("ix_role_switches_instance_id", "role_switches", ["instance_id"])
    op.create_index("ix_role_switches_requested_at", "role_switches", ["requested_at"])


def downgrade() -> None:
    op.drop_index("ix_role_switches_requested_at", table_name="role_switches")
    op.drop_index("ix_role_switches_instance_id", table_name="role_switches")
    op.drop_table("role_switches")
    op.drop_index("ix_plan_decisions_created", table_name="plan_decisions")
    op.drop_table("plan_decisions")
