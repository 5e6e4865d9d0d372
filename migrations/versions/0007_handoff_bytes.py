"""requests.handoff_bytes and requests.handoff_held_tokens: the KV a request's handoff
moved, and the prompt tokens its decode instance held already (decode-side reuse)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("handoff_bytes", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("handoff_held_tokens", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("handoff_held_tokens")
        batch.drop_column("handoff_bytes")
