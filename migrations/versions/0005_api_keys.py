"""api_keys: gateway API keys, hashed at rest, each with a tenant and a rate limit

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False, server_default=""),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("rate_limit", sa.String(100), nullable=False, server_default=""),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("revoked", sa.Float, nullable=True),
    )
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_table("api_keys")
