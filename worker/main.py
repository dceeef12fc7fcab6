"""Entry point of a worker process (`lorafleet worker`)."""

from __future__ import annotations

import asyncio
import signal

from shared.config import WorkerConfig


def run_worker(config: WorkerConfig) -> int:
    """Serve jobs until SIGINT/SIGTERM; returns the process exit code. The caller sets up logging
    (`lorafleet worker` does, with its --log-level), as it does for the gateway."""
    from kernels.lora.configs import set_plan_cache_dir
    from worker.device_share import apply_device_share
    from worker.service import Worker  # torch is imported only once we are sure to need it

    apply_device_share(config.engine)
    # plans tuned on this machine (at a start, or by `lorafleet tune`) win over the packaged ones
    set_plan_cache_dir(config.kernel_plans_dir)

    async def serve() -> int:
        worker = Worker(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(serve())
    finally:
        # not asyncio.run, whose exit cancels every task left and waits for them all: a loop that ignored its
        # cancellation (the stop left it behind, shared/tasks.py) would hang the exit
        loop.close()
