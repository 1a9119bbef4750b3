"""How every vLLM engine the test suite starts is configured: the platform's replicas (the
session app and the apps tests deploy, `rollout serve` on the test hosts), the reference
engines (tests/reference.py, tests/lora.py, tests/host_trainer.py) and the reference
`vllm serve` (built from the session app's model config). A leaf module, so that
tests/hosts.py (which tests/conftest.py imports) and the test hosts' processes can use it.
"""

from __future__ import annotations

# Eager (vLLM's enforce_eager, rollout's model.enforce_eager): vLLM's CPU platform otherwise
# compiles the model at every engine start (torch.compile, DYNAMO_TRACE_ONCE + inductor),
# about 6 s of CPU on the 2-core machine: an AsyncLLM on the demo model measured 12.4-13.1 s
# to start compiled, 6.9-7.0 s eager, and the suite starts dozens (issue 28). Eager and
# compiled kernels may round differently, and tests compare the platform's greedy tokens and
# logprobs with reference engines exactly: every engine in a comparison runs in this one
# mode. The platform's defaults stay compiled (rollout.local.CPU_MODEL_DEFAULTS); CI's soak
# and fuzz runs cover that path.
ENFORCE_EAGER = True
MAX_MODEL_LEN = 512
KV_BYTES = 256 << 20
# A test engine's model section (over rollout.local.CPU_MODEL_DEFAULTS, or in a YAML config).
TEST_MODEL = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_BYTES, "enforce_eager": ENFORCE_EAGER}
