"""The soak's trainer: a separate process (so the soak can kill it mid-publish) that
publishes a perturbed copy of the served model over and over, and says on stdout what
each publish did: ``COMMITTED <version>`` or ``FAILED <error type>: <message>``.

``python -m rollout.soak.trainer MODEL_DIR APP_NAME PERIOD_S`` inside the Ray cluster
(``RAY_ADDRESS`` set by the soak).
"""

from __future__ import annotations

import os
import sys
import time


def main(model_dir: str, app_name: str, period_s: float) -> None:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.errors import RolloutError
    from rollout.sync import WeightPublisher

    ray.init(address=os.environ["RAY_ADDRESS"], namespace="rollout-soak", log_to_driver=False)
    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters()}
    publisher = WeightPublisher.connect(app_name=app_name, timeout_s=120)
    step = 0
    while True:
        step += 1
        g = torch.Generator().manual_seed(step)
        tensors = {n: t + torch.randn(t.shape, generator=g) * 0.01 for n, t in base.items()}
        print(f"PUBLISHING {step}", flush=True)
        try:
            print(f"COMMITTED {publisher.publish(tensors)}", flush=True)
        except RolloutError as e:
            print(f"FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            publisher.close()  # the next round forms a fresh group
        time.sleep(period_s)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
