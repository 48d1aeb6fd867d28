"""Rank ``r > 0`` of a multi-rank trainer: runs the commands rank 0 sends on stdin.

    python -m roles.trainer.rank RANK WORLD_SIZE MASTER_HOST:PORT

Started by ``roles.trainer.group.Ranks`` (never by hand). It joins the process group,
loads the model, then for each command runs the same ``ShardedCore`` call as rank 0, so
both enter the same collectives. End of input (rank 0 closed the pipe or died) ends it
with code 0; any failure ends it with code 1 after one log line, which fails rank 0's
next collective or command (``GroupBroken``) and restarts the group. Ctrl-C is left to
rank 0, which stops the ranks in order.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from bus.log import configure, get_logger
from configs import RunConfig
from roles.trainer.group import Gather, Init, Load, Reconfigure, Save, Train, read_command
from roles.trainer.sharded import ShardedCore


def serve(rank: int, world_size: int, master: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    init = read_command(stdin)
    if not isinstance(init, Init):
        print(f"trainer rank {rank}: expected Init first, got {init!r}", file=sys.stderr)
        return 1
    configure(run=init.run, role="trainer", json=True)
    log = get_logger(run=init.run, role="trainer", rank=rank)
    try:
        cfg = RunConfig.model_validate(init.config)
        core = ShardedCore(
            cfg, init.model_dir, rank=rank, world_size=world_size, master=master,
            device=init.device,
        )  # fmt: skip
        log.info("trainer.rank_ready", world_size=world_size, device=core.device)
        while (command := read_command(stdin)) is not None:
            match command:
                case Train(batch=batch):
                    core.train_step(batch)
                case Gather():
                    core.weights_bytes()
                case Save(folder=folder):
                    core.write_snapshot(Path(folder))
                case Load(folder=folder):
                    core.load_checkpoint(folder)
                case Reconfigure(config=config):
                    core.reconfigure(RunConfig.model_validate(config))
                case _:
                    raise ValueError(f"unexpected command {command!r}")
    except Exception as e:  # noqa: BLE001 - one line, then the group goes down
        log.error("trainer.rank_failed", error=f"{type(e).__name__}: {e}")
        return 1
    core.close()
    log.info("trainer.rank_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
