"""The shared request path validates (renders chat templates, tokenizes) on threads, never on the event loop."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from gateway.frontend import Frontend
from gateway.metrics import GatewayMetrics
from gateway.validation import ModelSpec

MODEL = ModelSpec(name="tiny", max_model_len=8, vocab_size=4, fingerprint="fp")


def test_a_slow_validation_leaves_the_event_loop_free_for_other_requests():
    released = threading.Event()
    seen = {}

    def slow_validate(body, model, tokenizer, running_ids):
        seen["thread"] = threading.current_thread().name
        # Released by a coroutine on the event loop: if this ran on the loop, nothing could release it.
        return "validated" if released.wait(10) else "the loop was blocked"

    frontend = Frontend(MODEL, None, SimpleNamespace(running_ids=set()), GatewayMetrics())

    async def scenario():
        big = asyncio.ensure_future(frontend.validate(slow_validate, {"prompt": "..."}))
        while "thread" not in seen:
            await asyncio.sleep(0.001)
        assert not big.done()
        released.set()                                   # "another request" served while the big one runs
        return await big

    try:
        assert asyncio.run(scenario()) == "validated"
    finally:
        frontend.close()
    assert seen["thread"].startswith("gateway-validate")
