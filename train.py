#!/usr/bin/env python
"""Train a ReDrafter drafter by distillation: ``python train.py --config configs/tiny.yaml``.

The same as ``redrafter-jax train``; all logic lives in ``redrafter_jax.training.trainer``.
Examples:

  python train.py --config configs/smollm2_135m.yaml train.num_steps=2000 train.batch_size=16
  python train.py --config configs/tiny.yaml --stop-after-steps 5     # a time-boxed slice

Run it again with the same ``train.output_dir`` to resume from the newest checkpoint. On several
hosts, start one process per host with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or ``--distributed-auto`` under SLURM / Open MPI / Kubernetes).
"""

import sys

from redrafter_jax.cli import main

if __name__ == "__main__":
  sys.exit(main(["train", *sys.argv[1:]]))
