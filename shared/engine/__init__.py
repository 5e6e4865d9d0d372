"""Halfmoon's engine: scheduler and block manager (bookkeeping) around the paged model.

Importing the package applies `HALFMOON_CPU_ISA`'s caps for ATen and oneDNN to this
process (see cpu.py) before any engine module imports torch, which reads them once.
"""

from shared.engine.cpu import apply_isa_env

apply_isa_env()
