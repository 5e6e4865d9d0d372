"""kvmanager: the cluster-wide KV index and capacity accounting; trace replay over the
engines' own block pool (pool.py drives shared/engine/block_manager.py by hash)."""
