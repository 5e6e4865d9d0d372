"""Start-up steps every engine instance takes before serving."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from services.worker.settings import WorkerSettings
from shared.cpus import parse_cpus
from shared.engine import architectures, omp
from shared.engine.runner import LoadedModel, load_model
from shared.lifecycle import new_instance_id, setup_logging
from shared.model_context import for_model
from shared.model_store import ensure_model
from shared.settings import S


def with_instance_id(settings: S, role: str) -> S:
    if getattr(settings, "instance_id", ""):
        return settings
    return settings.model_copy(update={"instance_id": new_instance_id(role)})


async def load_for(settings: WorkerSettings, role: str) -> LoadedModel:
    setup_logging(settings.log_level, role, settings.instance_id)
    if settings.nice:
        os.nice(settings.nice)
    if settings.cpus:  # before torch starts its threads: they inherit the mask
        os.sched_setaffinity(0, parse_cpus(settings.cpus))
    omp.serial()  # the main thread: only the engine thread gets a team (omp.py)
    model_dir = await asyncio.to_thread(ensure_model, settings.model)
    name = settings.served_model_name or model_dir.name
    try:
        architectures.check_folder(model_dir)  # UnsupportedModel: a ValueError
        context = for_model(model_dir, settings.max_model_len, settings.rope_scaling)
    except ValueError as exc:
        raise SystemExit(f"{role}: {exc}") from None  # a setting at fault: one line, no trace
    # On a thread that ends with the load, taking its OpenMP team along (omp.py).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as loader:
        return await asyncio.get_running_loop().run_in_executor(
            loader,
            load_model,
            model_dir,
            settings.dtype,
            settings.device,
            settings.threads,
            name,
            context,
        )
